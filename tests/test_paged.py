"""FKV sized by real length (``dense.PagedPool``): K/V in blocks, a request admitted when the free blocks cover its
prompt and generation, its blocks freed at its end.

It must give HF's own ``generate`` (greedy, its default cache) token for token and HF's full forward's logits
within 1e-4, on mixed lengths with requests ending early (EOS honoured, a stop, their own ``max_new_tokens``), on
Llama, Qwen2, Mistral and Phi-3 shapes; never hold more blocks than its pool (the planner's K/V bytes, measured);
admit in queue order and only what fits; and refuse a block size that is not a positive integer in one line.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_full_cache_logits, tiny_random_model

from batchmax_tp.core.dense import PagedPool
from batchmax_tp.core.engine import Engine
from batchmax_tp.core.method import FullCache, Method, make_method
from batchmax_tp.core.requests import Record, Request, Sampling
from batchmax_tp.core.scheduler import Scheduler
from batchmax_tp.core.step import PoolState
from batchmax_tp.plan.planner import ModelShape, predict_pool

ATOL = 1e-4
LENGTHS = [5, 40, 17, 63, 9, 33, 64, 2]
NEW = [9, 3, 12, 6, 15, 1, 8, 11]
FAMILIES = {
    "llama": dict(family="llama"),
    "qwen2": dict(family="qwen2"),
    "mistral": dict(family="mistral", sliding_window=None),
    "phi3": dict(family="phi3", num_key_value_heads=4),  # fused qkv, no GQA
}


def model_of(family: str):
    kw = dict(FAMILIES[family])
    return tiny_random_model(kw.pop("family"), seed=0, **kw)


def prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]


def hf_alone(model, prompt: list[int], new: int, eos: int | None):
    """HF's own greedy ``generate`` of one prompt (its default cache): the tokens through EOS."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=eos if eos is not None else -1,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    return out[: out.index(eos) + 1] if eos is not None and eos in out else out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("block", [4, 16])
def test_paged_fkv_equals_hf_generate_on_mixed_lengths_ending_early(family, block):
    model = model_of(family)
    requests = [Request(p, n) for p, n in zip(prompts(), NEW)]
    plain = Engine(model, Method("fkv", block=block), 2).run(requests, Sampling(ignore_eos=True))
    # EOS honoured: a token the plain run emits early in several requests ends them there
    eos = next(t for o in plain.outputs for t in o.tokens[1:3] if o.tokens.count(t))
    for slots in (1, 3):
        engine = Engine(model, Method("fkv", block=block), slots)
        out = engine.run(requests, Sampling(eos_token_id=eos), record=Record(logits=True))
        ended_early = 0
        for i, (r, o) in enumerate(zip(requests, out.outputs)):
            want = hf_alone(model, r.input_ids, r.max_new_tokens, eos)
            assert o.tokens == want, f"request {i} ({LENGTHS[i]} tokens, {slots} slots): {o.tokens} vs HF {want}"
            ended_early += len(want) < r.max_new_tokens
            hf = hf_full_cache_logits(
                model,
                torch.tensor([r.input_ids]),
                torch.ones(1, LENGTHS[i], dtype=torch.long),
                torch.tensor([o.tokens]),
            )
            err = max(float((a - b[0]).abs().max()) for a, b in zip(o.logits, hf))
            assert err <= ATOL, f"request {i}: logits differ from HF's full forward by {err}"
        assert ended_early >= 1  # the EOS ended some request before its max_new_tokens


def test_admission_never_holds_more_blocks_than_the_pool_and_kv_is_the_planners(monkeypatch):
    """Blocks held (summed over the rows, after each change of the pool) never pass the pool's; its K/V bytes are the
    planner's for the memory of ``slots`` rows; shorter requests run more at once than ``slots`` rows."""
    model = model_of("llama")
    method = Method("fkv", block=8)
    most, pools, states = [0], [], []
    initial, changed = PagedPool.initial, PoolState.changed

    def starting(self):
        pools.append(self)
        return initial(self)

    def changing(self, change):
        new = changed(self, change)
        held = [b for table in new.paging.tables for b in table]
        most[0] = max(most[0], len(held))
        assert sorted(held + list(new.paging.free)) == list(range(pools[0].num_blocks))  # each block held or free, once
        states.append(new)
        return new

    monkeypatch.setattr(PagedPool, "initial", starting)
    monkeypatch.setattr(PoolState, "changed", changing)
    requests = [Request(p, n) for p, n in zip(prompts(), NEW)]
    out = Engine(model, method, 2).run(requests, Sampling(ignore_eos=True))
    pool = pools[0]
    longest = max(method.capacity(s, t) for s, t in zip(LENGTHS, NEW))  # 70: 9 blocks of 8 per slot
    assert pool.num_blocks == 2 * -(-longest // 8) and not any(states[-1].paging.tables)  # every block given back
    assert 0 < most[0] <= pool.num_blocks
    assert len({slot for _, slot, _ in out.admissions}) > 2  # more requests at once than 2 fixed slots
    want = predict_pool(ModelShape.from_config(model.config), method, 2, 64, 8).kv  # the longest request's
    assert out.peak_kv_bytes == want == 2 * 2 * 2 * (pool.num_blocks + 1) * 8 * 16 * 4  # K+V, 2 layers, 2 heads


def test_the_scheduler_admits_in_queue_order_what_the_free_blocks_cover():
    """Blocks [6, 2, 5, 1] of a 7-block pool in 4 rows: 6 enters alone; 2 waits for it (never passed over by 1);
    then 2, 5 enter together (7 blocks); 1 waits for a free block."""
    sched = Scheduler(Method("fkv", block=4), [20, 4, 16, 2], [5, 5, 5, 5], 4, blocks=7, need=[6, 2, 5, 1])
    step = sched.next_step()
    assert [w.row for w in step.work] == [0] and sched.free_blocks == 1
    while step is not None and not any(i == 1 for _, _, i in sched.log):
        sched.complete(step)
        step = sched.next_step()
    assert [i for _, _, i in sched.log] == [0, 1, 2] and sched.free_blocks == 0
    with pytest.raises(ValueError, match="at most the pool's 7 blocks"):
        Scheduler(Method("fkv", block=4), [20], [5], 1, blocks=7, need=[8])


@pytest.mark.parametrize("value", ["-1", "1.5", "x", "True"])
def test_a_block_size_that_is_not_a_positive_integer_is_one_line(value):
    with pytest.raises(ValueError) as err:
        make_method(f"fkv:block={value}")
    assert "\n" not in str(err.value) and "block" in str(err.value)
    with pytest.raises(ValueError, match="block must be a positive integer"):
        FullCache(block=-4)
    assert make_method("fkv:block=0").paged is False and make_method("fkv").block == 64
