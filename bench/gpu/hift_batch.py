"""On a CUDA machine: HiFT of R streams' chunks per stream (today), batched eagerly and batched with CUDA
graphs (engine.hift_batch / engine.hift_graphs): max |difference| against each stream alone and ms per
call, for R = 1, 4, 16 at the chunk lengths of the official schedule (a first chunk of 80 frames without
source cache; mid chunks of 108 and 208 with the 8-frame mel cache and a 3840-sample source cache). NSF
noise on, each stream with its own CUDA generator. Prints one JSON line per case and writes a report.

    python3 -m bench.gpu.hift_batch /tmp/full out/hift_batch.json   # a model folder with hift.pt
    python3 -m bench.gpu.hift_batch - out/hift_batch.json           # builds the `full` HiFT (random)

Expect: alone == hift.inference bit for bit; batched and graphed equal alone to float rounding (rows never
interact; the F0 predictor runs per row; on the CPU the full HiFT gave 3.7e-5 on a wave RMS of 0.03);
capture_failures 0 (else that case ran eagerly).
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from app.model.hift import HiFTGenerator, normalize_hift_state_dict
from app.model.hift_batch import make_row, vocode_rows
from app.model.hift_graphs import HiftGraphs
from app.model.hparams import load_hparams
from app.model.loader import load_strict
from app.model.random.init import calibrate_hift, calibration_mel, randomize
from app.model.random.sizes import FULL
from app.model.random.tokenizer_files import write_qwen_config
from app.model.random.yaml_template import render_cosyvoice2_yaml
from app.model.token2wav import SOURCE_CACHE_SAMPLES
from bench.gpu.timing import timed


def build_hift(model_dir: str) -> HiFTGenerator:
    """hift.pt of `model_dir`, or (model_dir '-') the `full` size with random weights, as make_model does."""
    if model_dir != "-" and (Path(model_dir) / "hift.pt").is_file():
        hift = HiFTGenerator(load_hparams(model_dir).hift, nsf_noise=True)
        load_strict(hift, Path(model_dir) / "hift.pt", transform=normalize_hift_state_dict)
        return hift
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cosyvoice2.yaml").write_text(render_cosyvoice2_yaml(FULL), encoding="utf-8")
        write_qwen_config(Path(tmp) / "CosyVoice-BlankEN", FULL)  # load_hparams reads it too
        hp = load_hparams(tmp)
    hift = HiFTGenerator(hp.hift, nsf_noise=True).eval()
    randomize(hift, torch.Generator().manual_seed(0))
    hift.nsf_noise = False  # calibrated on the deterministic source, as make_model
    calibrate_hift(hift, calibration_mel(hp.feat))
    hift.nsf_noise = True
    return hift


def main(model_dir: str, out: str) -> None:
    hift = build_hift(model_dir).remove_weight_norm().cuda().eval()
    graphs = HiftGraphs()
    graphs.capture(hift, [1, 4, 16], [80, 108, 208])  # every case's bucket, before the first call
    g = torch.Generator().manual_seed(1)
    cases = []
    for frames, cached in ((80, False), (108, True), (208, True)):
        for n_rows in (1, 4, 16):
            mels = [(torch.randn(1, 80, frames, generator=g) * 2 - 5).cuda() for _ in range(n_rows)]
            caches = [(0.1 * torch.randn(1, 1, SOURCE_CACHE_SAMPLES, generator=g)).cuda() if cached else None
                      for _ in range(n_rows)]
            seeds = [1000 * frames + 10 * n_rows + i for i in range(n_rows)]
            rows = [make_row(hift, m, c, torch.Generator(device="cuda").manual_seed(s))
                    for m, c, s in zip(mels, caches, seeds, strict=True)]
            with torch.inference_mode():
                today = [hift.inference(m, c, generator=torch.Generator(device="cuda").manual_seed(s))
                         for m, c, s in zip(mels, caches, seeds, strict=True)]
            alone = [vocode_rows(hift, [r])[0] for r in rows]
            batched = vocode_rows(hift, rows)
            graphed = vocode_rows(hift, rows, graphs)

            def diff(a, b, k=0):
                return max((x[k] - y[k]).abs().max().item() for x, y in zip(a, b, strict=True))

            case = {
                "frames": frames, "rows": n_rows, "source_cache": cached,
                "alone_equals_inference": all(torch.equal(a[0], t[0]) and torch.equal(a[1], t[1])
                                              for a, t in zip(alone, today, strict=True)),
                "batched_vs_alone_wave": diff(batched, alone), "batched_vs_alone_source": diff(batched, alone, 1),
                "graphed_vs_alone_wave": diff(graphed, alone), "graphed_vs_batched_wave": diff(graphed, batched),
                "wave_rms": float(torch.cat([a[0] for a in alone]).pow(2).mean().sqrt()),
                "per_stream_eager_ms": round(timed(lambda rows=rows: [vocode_rows(hift, [r]) for r in rows]), 2),
                "batched_eager_ms": round(timed(lambda rows=rows: vocode_rows(hift, rows)), 2),
                "batched_graph_ms": round(timed(lambda rows=rows: vocode_rows(hift, rows, graphs)), 2),
            }
            case["graph_ms_per_row"] = round(case["batched_graph_ms"] / n_rows, 3)
            cases.append(case)
            print(json.dumps(case), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model_dir": model_dir,
              "hift_params": sum(p.numel() for p in hift.parameters()), "stats": vars(graphs.stats),
              "graphs_kept": graphs.n_graphs, "cases": cases,
              "memory_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
