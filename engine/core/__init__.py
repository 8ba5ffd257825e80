"""The engine's core: requests, the scheduler/runner contract, the block manager, the scheduler
and the config. Pure Python, no torch (tests/core/test_import_graph.py checks), testable on its own."""
