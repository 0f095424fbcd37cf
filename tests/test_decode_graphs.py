"""Decode steps through the graph runner's buffers (chatcore/engine/decode_graphs.py), on the CPU.

CUDA graphs exist only on a GPU (`make gpu-check` captures them there). What runs here is
everything around the capture: the ladder of sizes, the static buffer's layout and its padding
rows, the block copies before a replay, and the runner's choice between replay and eager. With
`capture=False` each "replay" runs the forward eagerly over the same static buffer, so a step
whose rows are padded must give exactly what the eager runner gives, and touch no block.
"""

from __future__ import annotations

import numpy as np
import pytest

from chatcore.engine.decode_graphs import FIELDS, host_layout, ladder
from chatcore.engine.request import SamplingParams
from tests.engine_helpers import QUESTIONS, add_all, chat_ids, run_to_end

pytestmark = pytest.mark.model
MAX_TOKENS = 12


def test_the_ladder_covers_every_batch_up_to_max_num_seqs() -> None:
    assert ladder(1) == [1]
    assert ladder(10) == [1, 2, 4, 8, 10]
    assert ladder(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert ladder(256)[-3:] == [224, 240, 256] and len(ladder(256)) == 20


def test_padding_rows_write_no_slot_and_read_no_context() -> None:
    tables = np.array([[7, 8], [9, 0]], dtype=np.int32)
    out = host_layout(4, 3, [11, 12], [30, 5], [120, 70], [31, 6], tables)
    assert out.size == 4 * (FIELDS + 3)
    assert out[0:4].tolist() == [11, 12, 0, 0]
    assert out[4:8].tolist() == [30, 5, 0, 0]
    assert out[8:12].tolist() == [120, 70, -1, -1]  # a negative slot: the store skips the row
    assert out[12:16].tolist() == [31, 6, 0, 0]  # context 0: the kernel reads nothing, gives zeros
    assert out[16:].reshape(4, 3).tolist() == [[7, 8, 0], [9, 0, 0], [0, 0, 0], [0, 0, 0]]


def _outputs(core, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    requests = [core.make_request(p, SamplingParams(max_tokens=MAX_TOKENS, n=n, temperature=0 if n == 1 else 1.0,
                                                    seed=7, ignore_eos=True)) for p in prompts]
    add_all(core, requests)
    finals = run_to_end(core)
    return [[seq.token_ids for seq in finals[r.request_id].outputs] for r in requests]


@pytest.mark.parametrize("chats", [3, 5])
def test_replayed_decode_steps_equal_the_eager_ones(make_core, loaded_fp32, chats: int) -> None:
    prompts = [chat_ids(loaded_fp32.tokenizer, q) for q in QUESTIONS[:chats]]
    eager = _outputs(make_core(), prompts)
    core = make_core(max_num_seqs=8)
    core.runner.enable_decode_graphs(8, core.scheduler.max_context, capture=False)
    assert core.runner.graphs is not None and core.runner.graphs.sizes == [1, 2, 4, 8]
    replays = []
    replay = core.runner.graphs.replay
    core.runner.graphs.replay = lambda size, values, rows: replays.append((size, rows)) or replay(size, values, rows)
    assert _outputs(core, prompts) == eager
    assert len(replays) >= MAX_TOKENS - 1  # every decode-only step went through a graph's buffer
    assert all(rows <= size < 2 * rows for size, rows in replays), replays  # padded to the next size


def test_forked_samples_copy_their_blocks_before_the_replay(make_core, loaded_fp32) -> None:
    """n=2 shares the prompt's last block until each sample writes it: the copy runs before the replay."""
    prompts = [chat_ids(loaded_fp32.tokenizer, QUESTIONS[0])]
    eager = _outputs(make_core(), prompts, n=2)
    core = make_core(max_num_seqs=4)
    core.runner.enable_decode_graphs(4, core.scheduler.max_context, capture=False)
    assert _outputs(core, prompts, n=2) == eager
