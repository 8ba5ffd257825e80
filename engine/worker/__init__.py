"""The torch side: the model runner executes a `SchedulerOutput` (inputs, CUDA graphs, the
model, attention, sampling) and returns a `RunnerOutput`. It never mutates request state."""
