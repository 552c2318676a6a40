"""Command line: `python -m mok [train|demo|bench] ...`.

train  the main job (also what `python -m mok` runs with no command): train a small
       mixture-of-experts byte-level language model with mok.nn.MoE feed-forwards on the bundled
       public-domain corpus, print the loss and tokens/s, write summary.json and loss.png
       (mok/train.py; `python -m mok train --help`). On CPU it trains the tiny model with the
       pure-PyTorch reference experts unless --backend mok is given, since Triton's interpreter
       takes seconds per layer and step.
demo   run one forward and backward of the fused layer on a small problem (compiled kernels on a
       GPU, Triton's interpreter on CPU), check it against the reference and print the result.
bench  the layer benchmark (benchmarks/layer.py; run from the repository root); with --ep N the
       expert-parallel benchmark on N GPUs (benchmarks/ep.py).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def demo(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m mok demo")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--shared", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import mok.functional as F
    from mok.testing import GRAD_NAMES, assert_close, make_inputs, moe_reference_grads

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs = make_inputs(args.tokens, args.hidden, args.intermediate, args.experts, args.topk,
                         shared_intermediate_size=args.shared, device=device, seed=args.seed)
    config = F.MoKConfig()
    workspace = F.get_workspace(config, None, device=device, num_local_tokens=args.tokens,
                                hidden_size=args.hidden, topk=args.topk)
    mode = "compiled Triton kernels" if device.type == "cuda" else "Triton interpreter (CPU)"
    print(f"mok demo on {device} ({mode}): T={args.tokens} H={args.hidden} "
          f"I={args.intermediate} E={args.experts} k={args.topk} I_s={args.shared}")
    start = time.perf_counter()
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=args.experts)
    y, context = F.forward(config, workspace, schedule, *inputs.layer_args)
    grads = F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args)
    F.check_errors(workspace)
    elapsed = time.perf_counter() - start
    print(f"forward + backward: {elapsed:.2f} s (first call includes compilation)")
    print(f"tokens per expert: {schedule.expert_counts.tolist()}")
    print(f"saved for backward: {context.nbytes / 2**20:.2f} MiB (h only)")
    y_ref, grads_ref = moe_reference_grads(inputs, compute_dtype=torch.float32)
    print("against the mok.testing reference (fp32):")
    for name, actual, expected in zip(("y", *GRAD_NAMES), (y, *grads), (y_ref, *grads_ref),
                                      strict=True):
        if expected is not None:
            print("  " + str(assert_close(actual, expected, dtype=inputs.x.dtype, name=name)))
    print("ok")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else ("train", argv)
    if command == "train":
        from mok import train

        train.main(rest)
    elif command == "demo":
        demo(rest)
    elif command == "bench":
        expert_parallel = any(arg == "--ep" or arg.startswith("--ep=") for arg in rest)
        try:
            from benchmarks import ep, layer
        except ImportError as exc:
            raise SystemExit("`python -m mok bench` runs from the repository root "
                             f"(benchmarks/ must be importable): {exc}") from exc
        (ep if expert_parallel else layer).main(rest)
    else:
        raise SystemExit(f"unknown command {command!r}; use train, demo or bench")


if __name__ == "__main__":
    main()
