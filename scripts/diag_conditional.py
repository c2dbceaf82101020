"""Which work a conditional WHILE node's body cannot hold on this GPU machine, op by op.

The decoder's capture with conditional nodes ended the process (a segfault as torch's capture ended) on an H200
(driver 580, CUDA 13.0, torch 2.11, cuda-python 13.3), where loops of elementwise work captured and replayed
(docs/benchmarks.md). Each variant below runs in a process of its own (a segfault ends only it): a loop whose
body holds one kind of the decoder's work, then the decoder itself with and without cuDNN. scripts/gpu_check.sh
runs it when its conditional smoke decode fails; by hand:

    python scripts/diag_conditional.py [--budget-s 75] [VARIANT ...]   # logs under $OUT (else ./diag_out)
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import subprocess
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPS = ("lstm_cudnn", "gemm_f32", "gemm_bf16", "linear", "argmax_any", "index_select_scatter", "where_out",
         "lstm_cell", "elementwise", "nested")
DECODERS = ("decoder_rnnt", "decoder_rnnt_no_cudnn", "decoder_rnnt_fresh_streams", "decoder_tdt_no_cudnn")
# the most telling first, as a budget may cut the last: does the decoder still crash, without cuDNN, and with body
# streams new to the capture (as NeMo's, whose conditional mode ran there) instead of ones warmed up before it?
VARIANTS = DECODERS[:3] + tuple(f"loop_{name}" for name in LOOPS) + DECODERS[3:]
PASSES = 3  # body passes each loop runs


def _body_work(name: str, device) -> Callable[[], None]:
    """One kind of the decoder's work on fixed buffers, as a loop body would run it."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device, dtype)

    if name == "gemm_f32":
        a, b, c = rand(8, 64), rand(64, 96), rand(8, 96)
        return lambda: torch.mm(a, b, out=c)
    if name == "gemm_bf16":  # a Parakeet joint's size
        a, b = rand(128, 640, dtype=torch.bfloat16), rand(640, 1025, dtype=torch.bfloat16)
        out = torch.empty(128, 1025, device=device, dtype=torch.bfloat16)
        return lambda: out.copy_(a @ b)
    if name == "linear":
        layer = torch.nn.Linear(64, 96).to(device)
        x, out = rand(8, 64), torch.empty(8, 96, device=device)
        return lambda: out.copy_(layer(x))
    if name in ("lstm_cudnn", "lstm_cell"):
        lstm = torch.nn.LSTM(64, 64, num_layers=2).to(device)
        lstm.flatten_parameters()
        x, h, c = rand(1, 8, 64), rand(2, 8, 64), rand(2, 8, 64)
        if name == "lstm_cudnn":
            def step():
                _, (h2, c2) = lstm(x, (h, c))
                h.copy_(h2)
                c.copy_(c2)
            return step

        def cells():
            inp = x[0]
            for layer, (w_ih, w_hh, b_ih, b_hh) in enumerate(lstm.all_weights):
                h2, c2 = torch.lstm_cell(inp, (h[layer], c[layer]), w_ih, w_hh, b_ih, b_hh)
                h[layer].copy_(h2)
                c[layer].copy_(c2)
                inp = h2
        return cells
    if name == "argmax_any":
        logits, labels = rand(8, 100), torch.zeros(8, dtype=torch.long, device=device)
        any_out = torch.zeros((), dtype=torch.bool, device=device)

        def reduce():
            torch.argmax(logits, dim=-1, out=labels)
            torch.any(labels > 3, out=any_out)
        return reduce
    if name == "index_select_scatter":
        table, rows = rand(40, 64), torch.arange(8, device=device)
        picked, tokens = torch.empty(8, 64, device=device), torch.zeros(8, 16, dtype=torch.long, device=device)
        column = torch.zeros(8, 1, dtype=torch.long, device=device)

        def gather():
            torch.index_select(table, 0, rows, out=picked)
            tokens.scatter_(1, column, rows.unsqueeze(1))
        return gather
    if name == "where_out":
        mask, a, b = rand(8) > 0, torch.arange(8, device=device), torch.zeros(8, dtype=torch.long, device=device)
        return lambda: torch.where(mask, a, b, out=b)
    return lambda: None  # elementwise, nested: the counter alone


def run_loop(name: str) -> None:
    import torch

    from decoding.cuda_conditional import ConditionalGraphBuilder, load_condition_kernel

    device = torch.device("cuda:0")
    load_condition_kernel(device)
    work = _body_work(name, device)
    count, inner_count = (torch.zeros((), dtype=torch.int32, device=device) for _ in range(2))
    go, inner_go = (torch.ones((), dtype=torch.bool, device=device) for _ in range(2))
    streams = [torch.cuda.Stream(device) for _ in range(3)]
    for stream in streams:  # lazy library set-up (cuBLAS, cuDNN) per stream, before capture
        with torch.cuda.stream(stream):
            work()
    torch.cuda.synchronize()

    def inner_body():
        inner_count.add_(1)
        torch.lt(inner_count, PASSES, out=inner_go)

    def body():
        work()
        if name == "nested":
            inner_count.zero_()
            inner_go.fill_(True)
            builder.while_loop(inner_go, inner_body)
        count.add_(1)
        torch.lt(count, PASSES, out=go)

    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, stream=streams[0], capture_error_mode="thread_local"):
        builder = ConditionalGraphBuilder(device, streams[1:])
        builder.while_loop(go, body)
    print("captured", flush=True)
    count.zero_()
    go.fill_(True)
    graph.replay()
    torch.cuda.synchronize()
    print(f"replayed: {count.item()} passes (want {PASSES})", flush=True)
    assert count.item() == PASSES


def run_decoder(fixture: str, cudnn: bool, fresh_streams: bool = False) -> None:
    import torch

    from decoding import cuda_conditional
    from decoding.cuda_graphs import LabelLoopingDecoder
    from models import load_model

    torch.backends.cudnn.enabled = cudnn
    if fresh_streams:
        builder_init = cuda_conditional.ConditionalGraphBuilder.__init__

        def with_new_streams(self, device, body_streams):
            builder_init(self, device, [torch.cuda.Stream(device) for _ in body_streams])

        cuda_conditional.ConditionalGraphBuilder.__init__ = with_new_streams
    parity = os.environ.get("BATCHASR_PARITY_DIR", os.path.join(ROOT, ".carry", "nemo-parity"))
    model = load_model(os.path.join(parity, f"{fixture}.nemo"), device="cuda", dtype="float32")
    t = model.config.transducer
    graphs, eager = (LabelLoopingDecoder(model.decoder, model.joint, t.durations, t.max_symbols, cuda_graphs=mode)
                     for mode in ("conditional", "off"))
    for seed, (rows, frames) in enumerate(((1, 40), (8, 64), (16, 150))):
        g = torch.Generator().manual_seed(seed)
        encoded = torch.randn(rows, frames, model.config.encoder.d_model, generator=g).to("cuda")
        lengths = torch.randint(0, frames + 1, (rows,), generator=g)
        lengths[0] = frames
        same = graphs(encoded, lengths.to("cuda")) == eager(encoded, lengths.to("cuda"))
        print(f"{rows} rows x {frames} frames: mode {graphs.mode}, the same as eager: {same}", flush=True)
        assert same and graphs.mode == "conditional"


def run_variant(name: str) -> None:
    faulthandler.enable()
    sys.path.insert(0, ROOT)
    if name.startswith("loop_"):
        run_loop(name.removeprefix("loop_"))
    else:
        run_decoder("tdt" if "tdt" in name else "rnnt", cudnn="no_cudnn" not in name,
                    fresh_streams="fresh_streams" in name)
    print("OK", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", metavar="VARIANT", help=f"default: all of {', '.join(VARIANTS)}")
    parser.add_argument("--budget-s", type=float, default=75.0, help="begin no variant past this (each <= 20 s)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # the child process's part
    args = parser.parse_args()
    if args.variant:
        run_variant(args.variant)
        return
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    import torch

    if not torch.cuda.is_available():
        print("no CUDA here: nothing to find out")
        return
    out = os.environ.get("OUT", "diag_out")
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    for name in args.variants or VARIANTS:
        left = args.budget_s - (time.monotonic() - started)
        if left < 8:
            print(f"{name}: not run (budget spent)", flush=True)
            continue
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, __file__, "--variant", name], capture_output=True, text=True,
                                  timeout=min(20.0, left))
            text, status = proc.stdout + proc.stderr, ("ok" if proc.returncode == 0 else f"exit {proc.returncode}")
        except subprocess.TimeoutExpired as exc:
            text, status = f"{exc.stdout or ''}{exc.stderr or ''}", "timed out"
        with open(os.path.join(out, f"diag_{name}.log"), "w") as f:
            f.write(text if isinstance(text, str) else text.decode(errors="replace"))
        last = [line for line in str(text).splitlines() if line.strip()][-1:] or [""]
        print(f"{name}: {status} ({time.monotonic() - t0:.0f} s) {last[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
