"""``memtui estimate --hf-config``: a real transformers model built from a config on disk."""

from __future__ import annotations

import json
from typing import Any

from memtui import estimate
from tests.test_estimate import TINY_MISTRAL


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
