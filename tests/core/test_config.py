"""Config: presets load, overrides apply to the right section, bad values name the field."""
from pathlib import Path

import pytest

from engine.core.config import (ConfigError, EngineConfig, SpeculativeConfig, check_draft_model,
                                flat_field_names, load_config)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_presets_load(preset):
    config = load_config(CONFIGS / preset)
    assert config.scheduler.max_model_len <= 1024


def test_preset_names_its_model():
    assert load_config(CONFIGS / "gpt2-xl.yaml").model.model == "gpt2-xl"


def test_flat_overrides_reach_their_section():
    config = load_config(CONFIGS / "gpt2.yaml", block_size=32, dtype="bfloat16",
                         max_num_seqs=4, num_kv_blocks=None, scheduling_policy="priority",
                         num_cpu_threads=1)
    assert config.scheduler.scheduling_policy == "priority"
    assert config.model.num_cpu_threads == 1
    assert config.cache.block_size == 32
    assert config.model.dtype == "bfloat16"
    assert config.scheduler.max_num_seqs == 4
    assert "enable_prefix_caching" in flat_field_names()


@pytest.mark.parametrize("field, value", [
    ("block_size", 12), ("dtype", "float64"), ("max_model_len", 2048),
    ("gpu_memory_utilization", 1.5), ("max_num_seqs", 0), ("device", "tpu"),
    ("scheduling_policy", "lifo"), ("num_cpu_threads", 0)])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig.from_flat(**{field: value})


def test_unknown_field_is_rejected():
    with pytest.raises(ConfigError, match="blocksize"):
        EngineConfig.from_flat(blocksize=16)


# ---------------------------------------------------------------- speculative decoding
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def test_speculative_config_arrives_as_vllm_dict():
    config = load_config(speculative_config=NGRAM)
    assert config.speculative == SpeculativeConfig(4, "ngram", None, 4, 2)
    draft = load_config(speculative_config={"model": "gpt2", "num_speculative_tokens": 3})
    assert (draft.speculative.method, draft.speculative.model) == ("draft_model", "gpt2")
    assert draft.speculative.num_speculative_tokens == 3
    assert load_config().speculative is None


def test_speculative_section_of_a_preset(tmp_path):
    preset = tmp_path / "spec.yaml"
    preset.write_text("scheduler:\n  max_num_seqs: 8\nspeculative:\n  method: ngram\n"
                      "  num_speculative_tokens: 6\n  prompt_lookup_max: 3\n")
    config = load_config(preset, block_size=32)
    assert config.scheduler.max_num_seqs == 8 and config.cache.block_size == 32
    assert config.speculative == SpeculativeConfig(6, "ngram", None, 3, 3)
    # an override replaces the preset's section whole
    assert load_config(preset, speculative_config=NGRAM).speculative.prompt_lookup_min == 2


@pytest.mark.parametrize("low, high, expected", [(None, None, (5, 5)), (3, None, (3, 3)),
                                                 (None, 2, (2, 2)), (1, 7, (1, 7))])
def test_ngram_lookup_bounds_default_as_vllm(low, high, expected):
    spec = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": low,
                                        "prompt_lookup_max": high})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == expected


@pytest.mark.parametrize("change, field", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "eagle"}, "method"),
    ({"prompt_lookup_min": 5}, "prompt_lookup_min"),
    ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"model": "gpt2"}, "model"),  # ngram takes no model
    ({"method": "draft_model", "prompt_lookup_max": None, "prompt_lookup_min": None},
     "model"),  # a draft model method without a model
    ({"lookahead": 3}, "lookahead"),
])
def test_invalid_speculative_settings_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        load_config(speculative_config={**NGRAM, **change})


def test_speculative_config_needs_k_and_a_dict():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        load_config(speculative_config={"method": "ngram"})
    with pytest.raises(ConfigError, match="speculative_config"):
        load_config(speculative_config="ngram")


def test_drafts_must_fit_the_token_budget():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        load_config(max_num_batched_tokens=4, speculative_config=NGRAM)
    assert load_config(max_num_batched_tokens=5, speculative_config=NGRAM).speculative


def _hf(n_layer=12, n_embd=768, vocab_size=50257, n_positions=1024, **extra):
    return {"model_type": "gpt2", "n_layer": n_layer, "n_embd": n_embd, "n_head": 12,
            "vocab_size": vocab_size, "n_positions": n_positions, **extra}


def test_a_smaller_draft_with_the_same_vocabulary_passes():
    check_draft_model(target=_hf(n_layer=48, n_embd=1600), draft=_hf())
    check_draft_model(target=_hf(), draft=_hf())  # the target itself drafts: every token taken


@pytest.mark.parametrize("draft, rule", [
    (_hf(vocab_size=50304), "vocabulary"),
    (_hf(n_positions=512), "positions"),
    (_hf(n_layer=13), "larger"),
    (_hf(n_inner=4096), "larger"),
])
def test_unfit_drafts_are_rejected(draft, rule):
    with pytest.raises(ConfigError, match=rf"speculative_config\.model.*{rule}"):
        check_draft_model(target=_hf(), draft=draft)
