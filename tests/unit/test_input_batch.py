"""The persistent input batch packs every plan exactly as a fresh pack of that plan would.

`InputBatch` keeps page tables and sampling parameters per batch slot and updates them by
deltas (a new owner, pages added). Hypothesis drives the real scheduler through random
workloads (admissions, finishes, stop strings, preemptions under tight pools, aborts), one plan
in flight ahead as the engine runs it, and every plan packed by the persistent batch must equal
`pack_chunks` over the same rows plus the per-row sampling parameters filled from scratch. No
model and no compile: the arrays are compared on the host.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.models.step_batch import NO_SLOT, SeqChunk, pack_chunks, to_words
from jaxserve.runtime.input_batch import InputBatch
from jaxserve.runtime.model_runner import bucket_ladder, pick_bucket
from jaxserve.runtime.sampling import SamplingBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.request import PENDING_TOKEN, FinishReason, Request
from jaxserve.scheduling.scheduler import RequestRejected, Scheduler, SchedulerOutput
from jaxserve.scheduling.types import ScheduledSeq
from tests.unit.helpers import FakeRunner
from tests.unit.test_scheduler_random import configs, workloads


def _request(spec: dict, rng: np.random.Generator) -> Request:
    params = SamplingParams(
        max_tokens=spec["max_tokens"],
        temperature=float(rng.choice([0.0, 0.7, 1.3])),
        top_k=int(rng.choice([0, 5])),
        top_p=float(rng.choice([1.0, 0.9])),
        seed=int(rng.integers(0, 2**31)),
        logprobs=[None, 0, 3][int(rng.integers(0, 3))],
    )
    return Request(
        request_id=spec["id"],
        prompt_token_ids=spec["prompt"],
        sampling_params=params,
        arrival_time=float(spec["arrive"]),
        priority=spec["priority"],
    )


def _fresh(plan: SchedulerOutput, batch_of: InputBatch):
    """The reference: pack_chunks over the plan's rows and every sampling row filled anew."""
    chunks = [SeqChunk(s.token_ids, s.start_pos, s.page_table) for s in plan.seqs]
    total = sum(len(c.token_ids) for c in chunks)
    num_tokens = pick_bucket(batch_of.token_buckets, max(total, 1))
    num_seqs = batch_of.seq_bucket_for(num_tokens)
    batch = pack_chunks(
        chunks,
        page_size=batch_of.page_size,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        pages_per_seq=batch_of.tables.shape[1],
        num_pages=batch_of.num_pages,
    )
    sb = SamplingBatch.empty(num_seqs)
    for row, seq in enumerate(plan.seqs):
        p = seq.request.sampling_params
        sb.temperature[row], sb.top_k[row] = p.temperature, p.top_k
        sb.top_p[row], sb.min_p[row], sb.seeds[row] = p.top_p, p.min_p, p.seed
        sb.positions[row] = seq.end_pos
        sb.slots[row] = seq.slot
    asks = [s.request.sampling_params.logprobs for s in plan.seqs if s.sample]
    sb = dataclasses.replace(
        sb,
        want_top_logprobs=np.bool_(any(n for n in asks if n is not None)),
        want_logprobs=np.bool_(any(n is not None for n in asks)),
    )
    return batch, sb


def _check_pack(plan: SchedulerOutput, inputs: InputBatch) -> np.ndarray:
    step = inputs.pack(plan.seqs)
    batch, sb, special = step.batch, step.sampling, step.special_rows
    ref, ref_sb = _fresh(plan, inputs)
    pending = ref.token_ids == PENDING_TOKEN  # pack_chunks copies the placeholder as is
    for field in ("positions", "slot_mapping", "query_start", "kv_lens", "page_tables"):
        np.testing.assert_array_equal(getattr(batch, field), getattr(ref, field), err_msg=field)
    np.testing.assert_array_equal(batch.logits_indices, ref.logits_indices)
    assert int(batch.num_seqs) == int(ref.num_seqs)
    np.testing.assert_array_equal(batch.token_ids, np.where(pending, 0, ref.token_ids))
    # A pending token is fed from its own row's slot; nothing else is fed.
    row_of = np.searchsorted(ref.query_start[1:], np.arange(len(ref.token_ids)), side="right")
    slots = np.array([s.slot for s in plan.seqs] + [NO_SLOT], np.int32)
    expected_feed = np.where(pending, slots[np.minimum(row_of, len(plan.seqs))], -1)
    np.testing.assert_array_equal(batch.feed_slots, expected_feed)
    expected_keep = np.full(len(ref.kv_lens), NO_SLOT, np.int32)
    for row, seq in enumerate(plan.seqs):
        if seq.sample:
            expected_keep[row] = seq.slot
    np.testing.assert_array_equal(batch.sample_slots, expected_keep)
    for field in dataclasses.fields(SamplingBatch):
        if field.name in ("count_sampled", "presence_penalty", "frequency_penalty"):
            continue  # filled by the engine for special rows only (none here)
        np.testing.assert_array_equal(
            getattr(sb, field.name), getattr(ref_sb, field.name), err_msg=field.name
        )
    assert special.size == 0
    # What crosses to the device is the words of exactly these fields, bucket's layout included
    # (a field left over from an earlier pack of the bucket would show here).
    expected = to_words(
        (
            dataclasses.replace(
                ref,
                token_ids=np.where(pending, 0, ref.token_ids).astype(np.int32),
                feed_slots=expected_feed.astype(np.int32),
                sample_slots=expected_keep,
            ),
            ref_sb,
        )
    )
    shipped = step.words
    assert shipped.layout == expected.layout
    np.testing.assert_array_equal(shipped.words, expected.words)
    return shipped.words


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_persistent_batch_equals_a_fresh_pack_every_step(data):
    config = data.draw(configs())
    specs = data.draw(workloads(config))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    sched, runner = Scheduler(config), FakeRunner(config.page_size)
    buckets = bucket_ladder(1, config.max_num_batched_tokens)
    seq_buckets = bucket_ladder(1, config.max_num_seqs)
    inputs = InputBatch(
        max_seqs=config.max_num_seqs,
        pages_per_seq=config.max_pages_per_seq,
        page_size=config.page_size,
        num_pages=config.num_pages,
        token_buckets=buckets,
        seq_bucket_for=lambda t: pick_bucket(seq_buckets, min(t, seq_buckets[-1])),
    )
    accepted: dict[str, tuple[dict, Request]] = {}
    in_flight: collections.deque = collections.deque()
    last_shipped = None
    for now in range(400):
        for spec in (s for s in specs if s["arrive"] == now):
            req = _request(spec, rng)
            try:
                sched.add_request(req)
            except RequestRejected:
                continue
            accepted[spec["id"]] = (spec, req)
        for spec, _ in accepted.values():
            if spec["abort_at"] == now:
                sched.abort_request(spec["id"])
        plan = sched.schedule(now=float(now))
        if plan.seqs:
            shipped = _check_pack(plan, inputs)
            # The words a step was given stay as they were while later steps are packed into
            # the same bucket's buffer (the device may read them in place).
            if last_shipped is not None:
                np.testing.assert_array_equal(*last_shipped)
            last_shipped = (shipped, shipped.copy())
        in_flight.append((plan, runner.execute(plan)))
        while len(in_flight) > (0 if plan.is_empty else 1):
            old, result = in_flight.popleft()
            for update in sched.update(old, result, now=float(now)):
                spec, req = accepted[update.request.request_id]
                if not update.finished and req.num_output_tokens == spec["stop_string_at"]:
                    sched.finish_request(req.request_id, FinishReason.STOP)
        if now > 15 and not sched.has_unfinished():
            break
    while in_flight:
        sched.update(*in_flight.popleft())
    assert not sched.has_unfinished()


def test_a_request_readmitted_to_its_row_with_a_new_table_of_the_same_length_gets_it():
    """The directed case of the test above, which meets it in ~2% of its workloads: a request
    preempted and admitted again to the same slot gets a new page table from the KV manager
    (a new list), here as long as the old one. The row must take the new pages, not keep its
    copy of the old ones: same owner and same length must not read as "nothing changed"."""
    inputs = InputBatch(
        max_seqs=4,
        pages_per_seq=4,
        page_size=4,
        num_pages=16,
        token_buckets=(8, 16),
        seq_bucket_for=lambda t: 4,
    )
    req = Request(
        request_id="r",
        prompt_token_ids=list(range(1, 9)),
        sampling_params=SamplingParams(max_tokens=4, seed=1),
        arrival_time=0.0,
    )

    def prefill(table: list[int], step: int) -> SchedulerOutput:
        seq = ScheduledSeq(req, "r", 0, list(req.prompt_token_ids), 0, table, True)
        return SchedulerOutput(
            seqs=[seq], num_batched_tokens=8, preempted_ids=["r"], aborted_ids=[], step=step
        )

    _check_pack(prefill([3, 5], 1), inputs)
    readmitted = [9, 2]  # recomputed from the start into other pages, same slot, same length
    _check_pack(prefill(readmitted, 2), inputs)
    step = inputs.pack(prefill(readmitted, 3).seqs)
    assert step.batch.page_tables[0, :2].tolist() == readmitted
    assert step.batch.slot_mapping[:8].tolist() == [36, 37, 38, 39, 8, 9, 10, 11]


def test_extra_group_tables_pack_as_pack_chunks():
    """A hybrid pool's groups 1..G-1 (kv_pool.KVLayout): each row's extra tables, copied by
    deltas as they grow and replaced when new, pack as `pack_chunks(num_groups=3)` packs the same
    rows, write slots included; a uniform batch ships them with zero rows."""
    inputs = InputBatch(
        max_seqs=4,
        pages_per_seq=4,
        page_size=4,
        num_pages=32,
        token_buckets=(8, 16),
        seq_bucket_for=lambda t: 4,
        num_groups=3,
    )
    reqs = [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=list(range(1, 7)),
            sampling_params=SamplingParams(max_tokens=4, seed=i),
            arrival_time=0.0,
        )
        for i in range(2)
    ]
    tables = [[1, 2], [3, 4]]
    groups = [([5, 6], [7, 8]), ([9, 10], [11, 12])]

    def check(seqs):
        step = inputs.pack(seqs)
        chunks = [
            SeqChunk(s.token_ids, s.start_pos, s.page_table, group_tables=s.group_tables)
            for s in seqs
        ]
        ref = pack_chunks(
            chunks, page_size=4, num_tokens=len(step.batch.token_ids), num_seqs=4,
            pages_per_seq=4, num_pages=32,
            num_groups=3,
        )  # fmt: skip
        for name in ("page_tables", "slot_mapping", "group_tables", "group_slots"):
            np.testing.assert_array_equal(getattr(step.batch, name), getattr(ref, name), name)
        return step

    seqs = [
        ScheduledSeq(r, r.request_id, i, r.prompt_token_ids, 0, tables[i], True, 0, groups[i])
        for i, r in enumerate(reqs)
    ]
    step = check(seqs)
    assert step.batch.group_tables.shape == (2, 4, 4) and step.batch.group_slots.shape == (2, 16)
    assert step.batch.group_slots[1, :2].tolist() == [7 * 4, 7 * 4 + 1]
    for i in range(2):  # the tables grow: row 0's group 1 by a page, row 1's group 2 anew
        tables[i].append(20 + i)
        groups[i][0].append(24 + i)
    groups[1] = (groups[1][0], [13, 14, 15])
    seqs = [
        ScheduledSeq(r, r.request_id, i, [9, 9], 6, tables[i], True, 0, groups[i])
        for i, r in enumerate(reqs)
    ]
    check(seqs)
    uniform = pack_chunks([], page_size=4, num_tokens=8, num_seqs=2, pages_per_seq=4, num_pages=8)
    assert uniform.group_tables.shape == (0, 2, 4) and uniform.group_slots.shape == (0, 8)
    words = to_words(uniform)
    assert (
        words.words.size
        == to_words(dataclasses.replace(uniform, group_tables=None, group_slots=None)).words.size
    )
