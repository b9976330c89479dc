"""``memtui estimate --hf-config``: a real transformers model built from a config on disk."""

from __future__ import annotations

import json
from typing import Any

import pytest

from memtui.planning import estimate
from tests.integration.test_estimate import TINY_MISTRAL


def test_hf_config_builds_without_download(tmp_path: Any) -> None:
    """A Hugging Face config.json on disk: built, LoRA applied by module name, measured."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MISTRAL))
    options = estimate.Options(hf_config=str(config), seq_len=16, lora_rank=4, batch_size=2)
    result = estimate.estimate(options)
    assert result.lora_layers == 4  # q_proj and v_proj in two layers
    assert result.static.trainable_params == 2 * 4 * ((64 + 64) + (64 + 32))
    assert result.activations.method == "measured"
    assert "on the CPU" in result.activations.explanation


BASE_CLASSES = {
    "BertModel": {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    },
    "LlamaModel": {**TINY_MISTRAL, "architectures": ["LlamaModel"], "model_type": "llama"},
}


@pytest.mark.parametrize("name", list(BASE_CLASSES))
def test_base_classes_are_measured(tmp_path: Any, name: str) -> None:
    """BertModel and LlamaModel (a ModelOutput without logits): measured through
    last_hidden_state, with each attention kind; eager keeps the scores, sdpa does not."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(BASE_CLASSES[name]))
    per_sample = {}
    for attention in ("sdpa", "flash", "eager"):
        options = estimate.Options(hf_config=str(config), seq_len=128, attention=attention)
        result = estimate.estimate(options)
        assert result.activations.method == "measured", result.notes
        assert not any("could not run" in note for note in result.notes)
        implementation = "eager" if attention == "eager" else "sdpa"
        assert f"transformers model: attn_implementation={implementation}" in result.notes
        per_sample[attention] = result.activations.per_sample
    # eager keeps 2 layers x 4 heads x 128^2 scores at least once in fp32 (transformers
    # upcasts the softmax), the kernels keep none
    assert per_sample["eager"] - per_sample["sdpa"] >= 2 * 4 * 128 * 128 * 4
    assert per_sample["flash"] <= per_sample["sdpa"]


def test_bert_base_cased_has_the_parameters_accelerate_counts(tmp_path: Any) -> None:
    """BertModel(bert-base-cased) has 108,310,272 parameters, the estimate guide's accelerate row."""
    from benchmarks.estimate_refs import BERT_BASE_CASED

    config = tmp_path / "config.json"
    config.write_text(json.dumps(BERT_BASE_CASED_CONFIG))
    options = estimate.Options(hf_config=str(config), measure=False, optimizer="adam")
    result = estimate.estimate(options)
    assert result.static.total_params == BERT_BASE_CASED
    assert result.static.total == 16 * BERT_BASE_CASED


BERT_BASE_CASED_CONFIG = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "vocab_size": 28996,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}
"""bert-base-cased's config.json (the Hub's), the fields that set its size."""
