"""Config: presets load, overrides apply to the right section, bad values name the field."""
from pathlib import Path

import pytest

from engine.core.config import ConfigError, EngineConfig, flat_field_names, load_config

CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_presets_load(preset):
    config = load_config(CONFIGS / preset)
    assert config.scheduler.max_model_len <= 1024


def test_preset_names_its_model():
    assert load_config(CONFIGS / "gpt2-xl.yaml").model.model == "gpt2-xl"


def test_flat_overrides_reach_their_section():
    config = load_config(CONFIGS / "gpt2.yaml", block_size=32, dtype="bfloat16",
                         max_num_seqs=4, num_kv_blocks=None)
    assert config.cache.block_size == 32
    assert config.model.dtype == "bfloat16"
    assert config.scheduler.max_num_seqs == 4
    assert "enable_prefix_caching" in flat_field_names()


@pytest.mark.parametrize("field, value", [
    ("block_size", 12), ("dtype", "float64"), ("max_model_len", 2048),
    ("gpu_memory_utilization", 1.5), ("max_num_seqs", 0), ("device", "tpu")])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig.from_flat(**{field: value})


def test_unknown_field_is_rejected():
    with pytest.raises(ConfigError, match="blocksize"):
        EngineConfig.from_flat(blocksize=16)
