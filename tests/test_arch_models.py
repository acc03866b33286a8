"""Architecture-only models: the paper's model shapes with random weights, for throughput where weights are absent."""

from __future__ import annotations

import pytest
import torch

from batchmax_tp.bench.padded import generate
from batchmax_tp.core.method import Method
from batchmax_tp.models import architecture_config, architecture_model
from batchmax_tp.plan.planner import ModelShape


@pytest.mark.parametrize(
    "name,params", [("llama-2-7b", 6_738_415_616), ("llama-2-13b", 13_015_864_320), ("phi-3.5-mini", 3_821_079_552)]
)
def test_configs_have_the_published_parameter_counts(name, params):
    assert ModelShape.from_config(architecture_config(f"arch:{name}")).params == params


@pytest.mark.parametrize("name", ["llama-2-13b", "phi-3.5-mini"])
def test_shrunk_architecture_runs_with_eviction(name):
    # Same family and head layout, two layers and a narrow width so it runs on a CPU in a second.
    model = architecture_model(
        f"arch:{name}",
        dtype="float32",
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    assert sum(p.numel() for p in model.parameters()) == ModelShape.from_config(model.config).params
    ids = torch.randint(3, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, None, Method("bm", kv_max=16, p=4), 6, ignore_eos=True)
    assert out.tokens.shape == (2, 6)
    assert all(len(h) <= 16 for layer in out.kept_positions() for s in layer for h in s)


def test_unknown_architecture_is_named():
    with pytest.raises(FileNotFoundError, match="known: llama-2-13b, llama-2-7b, phi-3.5-mini"):
        architecture_config("arch:gpt-17")
