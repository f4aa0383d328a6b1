"""Batched HiFT across streams (app/model/hift_batch.py): every stream gets what it gets alone.

On the parity fixture's HiFT, interleaved streams of different chunk schedules (first chunks without
a source cache, mid chunks, finals, a speed-changed non-streaming final) are vocoded in batched calls
bucketed by mel length, and compared with each stream vocoded alone; the single-stream path is
compared bit for bit with today's per-chunk `hift.inference` code; the NSF noise stays per stream; and
through the whole pipeline, concurrent requests whose chunks share flow and HiFT calls give the audio
each gives alone (README tolerances)."""

from __future__ import annotations

import asyncio
import itertools
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_pipeline import collect, held_together, make_synth
from tolerances import BATCH_ATOL, WAVE_MAX_ATOL, WAVE_RMS_ATOL, within

from app.config import StreamingConfig
from app.engine.requests import SynthesisRequest
from app.model.flow_calls import FlowPrompt
from app.model.hift import HiFTGenerator, normalize_hift_state_dict
from app.model.hift_batch import length_buckets, make_row, vocode_rows
from app.model.hparams import load_hparams
from app.model.loader import load_strict
from app.model.token2wav import (
    CROSSFADE_SAMPLES,
    MEL_CACHE_FRAMES,
    SOURCE_CACHE_SAMPLES,
    ChunkPlan,
    Token2WavStream,
    _crossfade_windows,
)

pytestmark = pytest.mark.parity

# new flow frames per chunk of each stream (stream=True: a first chunk without caches, mid chunks with
# the 8-frame mel cache, a final; stream=False: one final), and the speed of a non-streaming final
SCHEDULES = (
    (True, 1.0, (80, 100, 60)),  # the official schedule of the fixture (HiFT frames 80, 108, 68)
    (True, 1.0, (80, 100, 60)),  # the same lengths: rows share every bucket
    (True, 1.0, (60, 100, 80)),  # another first hop; its mid chunk shares the 108-frame bucket
    (True, 1.0, (80, 100, 100, 40)),  # two mid chunks, a short final (48 frames)
    (True, 1.0, (80, 160)),  # a long final
    (False, 1.5, (240,)),  # non-streaming, speed 1.5: HiFT sees int(240 / 1.5) = 160 frames
    (False, 1.0, (80,)),  # non-streaming final of 80 frames: shares the first chunks' bucket (no cache)
)


def _hift(model_dir, *, nsf_noise: bool) -> HiFTGenerator:
    hift = HiFTGenerator(load_hparams(model_dir).hift, nsf_noise=nsf_noise)
    load_strict(hift, model_dir / "hift.pt", transform=normalize_hift_state_dict)
    return hift.remove_weight_norm().eval()


@pytest.fixture(scope="module")
def hifts(parity_model_dir) -> dict[bool, HiFTGenerator]:
    return {noise: _hift(parity_model_dir, nsf_noise=noise) for noise in (False, True)}


@pytest.fixture(scope="module")
def stream_mels(golden) -> list[list[torch.Tensor]]:
    """Per stream, its chunks' new flow frames [1, 80, n]: the fixture's flow mel, shifted per stream."""
    base = torch.from_numpy(golden("stream")["nonstream_0_flow_mel"])  # [1, 80, 240]
    out = []
    for k, (_, _, frames) in enumerate(SCHEDULES):
        mel = torch.roll(base, shifts=30 * k, dims=2) + 0.05 * k
        mel = torch.cat([mel, mel], dim=2)  # room for any schedule
        edges = np.cumsum((0, *frames))
        out.append([mel[:, :, a:b].contiguous() for a, b in itertools.pairwise(edges)])
    return out


def _streams(hift, seeds=None) -> list[Token2WavStream]:
    prompt = FlowPrompt(torch.zeros(1, 10, dtype=torch.long), torch.zeros(1, 20, 80), torch.zeros(1, 192))
    seeds = seeds or range(len(SCHEDULES))
    return [Token2WavStream(None, hift, prompt, StreamingConfig(), stream=stream, speed=speed,
                            generator=torch.Generator().manual_seed(100 + s))
            for (stream, speed, _), s in zip(SCHEDULES, seeds, strict=True)]


def _plan(k: int, i: int) -> ChunkPlan:
    stream, _, frames = SCHEDULES[k]
    return ChunkPlan(0, 0, streaming=stream, finalize=i == len(frames) - 1)


def _alone(hift, stream_mels, seeds=None) -> list[torch.Tensor]:
    """Each stream vocoded chunk by chunk on its own (Token2WavStream.vocode, batch 1)."""
    out = []
    for k, t2w in enumerate(_streams(hift, seeds)):
        waves = []
        for i, mel in enumerate(stream_mels[k]):
            waves.append(t2w.vocode(mel, _plan(k, i)))
            t2w.advance(_plan(k, i))
        out.append(torch.cat(waves))
    return out


def _interleaved(hift, stream_mels, seeds=None) -> tuple[list[torch.Tensor], list[int]]:
    """Round r vocodes every stream's r-th chunk (streams in a shuffled order) in batched calls, one per
    HiFT length; (audio per stream, rows of every call)."""
    streams, waves = _streams(hift, seeds), [[] for _ in SCHEDULES]
    order, sizes = torch.Generator().manual_seed(0), []
    for r in range(max(len(m) for m in stream_mels)):
        ks = [int(k) for k in torch.randperm(len(SCHEDULES), generator=order) if r < len(stream_mels[k])]
        rows = [streams[k].hift_row(stream_mels[k][r], _plan(k, r)) for k in ks]
        for bucket in length_buckets(rows):
            sizes.append(len(bucket))
            outs = vocode_rows(hift, [rows[b] for b in bucket])
            for b, (wav, source) in zip(bucket, outs, strict=True):
                k = ks[b]
                waves[k].append(streams[k].finish_vocoded(rows[b], wav, source, _plan(k, r)))
    return [torch.cat(w) for w in waves], sizes


def _today(hift, stream_mels) -> list[torch.Tensor]:
    """The per-stream code as it was before batching: `hift.inference` per chunk, caches and cross-fade."""
    out = []
    for k, (_, speed, _) in enumerate(SCHEDULES):
        gen = torch.Generator().manual_seed(100 + k)
        mel_cache = source_cache = tail = None
        waves = []
        for i, mel in enumerate(stream_mels[k]):
            final = _plan(k, i).finalize
            if mel_cache is not None:
                mel = torch.cat([mel_cache, mel], dim=2)
            if final and speed != 1.0:
                mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
            wav, source = hift.inference(mel, source_cache, generator=gen)
            if tail is not None:
                fade_in, fade_out = _crossfade_windows("hamming", CROSSFADE_SAMPLES, wav.device)
                wav = torch.cat([wav[:, :CROSSFADE_SAMPLES] * fade_in + tail * fade_out, wav[:, CROSSFADE_SAMPLES:]], 1)
            if not final:
                mel_cache, source_cache = mel[:, :, -MEL_CACHE_FRAMES:], source[:, :, -SOURCE_CACHE_SAMPLES:]
                tail, wav = wav[:, -CROSSFADE_SAMPLES:], wav[:, :-CROSSFADE_SAMPLES]
            waves.append(wav[0])
        out.append(torch.cat(waves))
    return out


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], bound: float) -> None:
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, k
        err = (a - b).abs()
        assert within(err.max(), WAVE_MAX_ATOL, "max") and within(err.pow(2).mean().sqrt(), WAVE_RMS_ATOL, "rms"), k
        assert within(err.max(), bound, "rows"), k


@pytest.mark.parametrize("nsf_noise", [False, True])
def test_single_stream_path_is_todays_code(hifts, stream_mels, nsf_noise):
    """Batch 1 through hift_row / vocode_rows / emit: bit-identical to the old per-chunk inference."""
    hift = hifts[nsf_noise]
    for k, (a, b) in enumerate(zip(_alone(hift, stream_mels), _today(hift, stream_mels), strict=True)):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("nsf_noise", [False, True])
def test_interleaved_batched_streams_equal_each_alone(hifts, stream_mels, nsf_noise):
    """Seven streams' chunks, interleaved, in calls of up to 7 rows: each stream's audio is its audio alone
    (README wave tolerances; and the batched-rows bound, as HiFT rows never interact)."""
    hift = hifts[nsf_noise]
    got, sizes = _interleaved(hift, stream_mels)
    assert max(sizes) >= 4 and sum(sizes) == sum(len(m) for m in stream_mels)  # real batches, every chunk once
    _assert_close(got, _alone(hift, stream_mels), BATCH_ATOL)


def test_noise_stays_per_stream(hifts, stream_mels):
    """With NSF noise on, a stream's rows draw from its own generator: swapping two streams' seeds
    changes their audio by far more than batching does."""
    hift = hifts[True]
    got, _ = _interleaved(hift, stream_mels)
    seeds = list(range(len(SCHEDULES)))
    seeds[0], seeds[1] = seeds[1], seeds[0]
    swapped = _alone(hift, stream_mels, seeds)
    for k in (0, 1):
        assert (got[k] - swapped[k]).abs().max() > 100 * BATCH_ATOL


def test_rows_are_checked_and_bucketed_by_length(hifts, stream_mels):
    hift = hifts[False]
    mel = stream_mels[0][0]
    rows = [make_row(hift, mel[:, :, :n], None, None) for n in (40, 30, 40, 50, 30)]
    assert length_buckets(rows) == [[0, 2], [1, 4], [3]]  # the first (most urgent) row's length first
    with pytest.raises(ValueError, match="cache_source"):
        make_row(hift, mel[:, :, :4], torch.zeros(1, 1, 4 * 480 + 1), None)
    with pytest.raises(ValueError, match="one stream"):
        make_row(hift, torch.cat([mel, mel]), None, None)
    with pytest.raises(ValueError, match="one mel length"):
        vocode_rows(hift, rows[:2])


# --- the engine: vocode_chunks and the scheduler's finish_batch ----------------------------------


def _chunk_jobs(hift, stream_mels, ks):
    """One real Utterance per stream k in `ks` (its Token2WavStream as in `_streams`), with its first chunk."""
    from app.engine.utterance import ChunkFinish, Segment, Utterance

    finishes, mels = [], []
    for k in ks:
        u = Utterance(SynthesisRequest(text="x", voice=None, stream=SCHEDULES[k][0], speed=SCHEDULES[k][1]), ["x"])
        u.segment = Segment(_streams(hift)[k], lm=None, tokens=[])
        finishes.append(ChunkFinish(u, _plan(k, 0)))
        mels.append(stream_mels[k][0])
    return finishes, mels


def _count_hift_calls(monkeypatch) -> dict[int, int]:
    """Batched HiFT calls of app.engine.utterance that ran, by rows (counted as each call returns)."""
    import app.engine.utterance as utterance

    sizes: dict[int, int] = {}
    inner = utterance.vocode_rows

    def counted(hift, rows, graphs=None):
        out = inner(hift, rows, graphs)
        sizes[len(rows)] = sizes.get(len(rows), 0) + 1
        return out

    monkeypatch.setattr(utterance, "vocode_rows", counted)
    return sizes


@pytest.mark.parametrize("fail_batches", [False, True])
def test_vocode_chunks_batches_and_isolates_a_bad_row(hifts, stream_mels, monkeypatch, fail_batches):
    """Five jobs of one flow call (first chunks, a speed-1.5 final, one broken mel): the good ones equal
    each stream alone, the broken one alone gets its error; a batched call that fails runs row by row."""
    import app.engine.utterance as utterance

    hift = hifts[True]
    ks = [0, 5, 1, 2, 6]
    finishes, mels = _chunk_jobs(hift, stream_mels, ks)
    mels[3] = mels[3][:, :79]  # a mel with 79 channels: make_row refuses it
    if fail_batches:
        real = utterance.vocode_rows

        def only_single_rows(hift, rows, graphs=None):
            if len(rows) > 1:
                raise RuntimeError("batched call failed")
            return real(hift, rows, graphs)

        monkeypatch.setattr(utterance, "vocode_rows", only_single_rows)
    sizes = _count_hift_calls(monkeypatch)
    got = {i: (r, e) for i, r, e in utterance.vocode_chunks(hift, finishes, mels, 0.25)}
    assert sorted(got) == list(range(5))
    assert isinstance(got[3][1], ValueError) and got[3][0] is None
    assert sizes == ({1: 4} if fail_batches else {3: 1, 1: 1})  # streams 0, 1, 6 share 80 frames; 5 has 160
    for i, k in enumerate(ks):
        if i == 3:
            continue
        t2w = _streams(hift)[k]
        want = t2w.vocode(stream_mels[k][0], _plan(k, 0)).numpy()
        samples, error = got[i]
        assert error is None and samples.shape == want.shape
        assert within(np.abs(samples - want).max(), BATCH_ATOL, "rows")
        u = finishes[i].utterance
        assert u.flow_s == 0.25 and u.hift_s > 0 and u.chunk_frames == [mels[i].shape[2]]
        assert u.segment.t2w.done == _plan(k, 0).finalize


def test_scheduler_finish_batch_hands_back_every_job():
    """finish_batch answers jobs in any order; a job it skips, or that waits when it raises, gets an error."""
    from app.engine.t2w_scheduler import Token2WavScheduler

    class Item:
        batch_key = 0

    def finish_batch(finishes, outs, flow_s):
        assert outs == ["mel"] * len(finishes)
        for i in reversed(range(len(finishes))):
            if finishes[i] == "skip":
                continue
            if finishes[i] == "boom":
                raise RuntimeError("boom")
            yield i, f"wave:{finishes[i]}", None

    async def scenario(names):
        s = Token2WavScheduler(1, flow_fn=lambda items: ["mel"] * len(items), max_batch=8, finish_batch=finish_batch)
        gate = threading.Event()
        blocker = asyncio.ensure_future(s.run(gate.wait, deadline=float("-inf")))
        jobs = [asyncio.ensure_future(s.run_flow(Item(), n, deadline=d)) for d, n in enumerate(names)]
        while s.queued() < len(names):
            await asyncio.sleep(0.01)
        gate.set()
        await blocker
        out = await asyncio.gather(*jobs, return_exceptions=True)
        s.shutdown()
        return [str(o) for o in out], s.batch_sizes

    out, sizes = asyncio.run(scenario(["a", "skip", "c"]))
    assert out == ["wave:a", "finish_batch returned no result for this job", "wave:c"] and sizes == {3: 1}
    out, _ = asyncio.run(scenario(["a", "boom", "c"]))
    assert out == ["boom", "boom", "wave:c"]  # c was answered before the error


# --- the whole pipeline -----------------------------------------------------------------------

TEXTS = ("Hello there, how are you today?", "A second request running at the same time, with more words in it.",
         "And a third one.")


def test_pipeline_concurrent_requests_share_hift_calls(parity_model_dir, voice, monkeypatch):
    """Three streamed requests (NSF noise on, seeded) held until their first chunks wait together: they
    share flow calls and batched HiFT calls, and each request's audio is what it gives alone."""
    synth = make_synth(parity_model_dir, nsf_noise=True, flow_batch=4)
    reqs = [SynthesisRequest(text=t, voice=voice, seed=5 + i, stream=True) for i, t in enumerate(TEXTS)]

    try:
        alone = [asyncio.run(collect(synth, r)) for r in reqs]
        sizes = _count_hift_calls(monkeypatch)
        both = asyncio.run(held_together(synth, reqs))
    finally:
        asyncio.run(synth.aclose())
    assert sum(n for rows, n in sizes.items() if rows > 1) >= 1, sizes  # some HiFT call held several requests' rows
    for conc, solo in zip(both, alone, strict=True):
        assert [c.samples.shape for c in conc] == [c.samples.shape for c in solo]
        a, b = (np.concatenate([c.samples for c in cs]) for cs in (conc, solo))
        err = np.abs(a - b)
        assert within(err.max(), WAVE_MAX_ATOL, "max") and within(np.sqrt((err**2).mean()), WAVE_RMS_ATOL, "rms")
        stats = conc[-1].stats
        assert stats.hift_s > 0 and len(stats.chunk_frames) == stats.n_chunks == len(conc)
