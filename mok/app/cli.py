"""Command line: `python -m mok COMMAND [options]`.

train  the main job: train a small mixture-of-experts byte-level language model with mok.nn.MoE
       feed-forwards on the bundled public-domain corpus, print the loss and tokens/s, write
       summary.json, loss.png and checkpoint.pt (mok/app/train.py; `python -m mok train --help`). On
       CPU it trains the tiny model with the pure-PyTorch reference experts unless --backend mok
       is given, since Triton's interpreter takes seconds per layer and step. Ctrl-C or SIGTERM
       saves a checkpoint after the step in progress and prints the command that resumes.
demo   run one forward and backward of the fused layer on a small problem (compiled kernels on a
       GPU, Triton's interpreter on CPU), check it against the reference and print the result.
bench  the layer benchmark (benchmarks/layer.py); with --ep N the expert-parallel benchmark on N
       GPUs (benchmarks/ep.py). The benchmarks ship with the source repository, not with the
       installed package: run it from the root of a clone.

`python -m mok`, `-h` and `--help` print the list of commands; each command takes --help. A
missing or unknown command is a usage error (exit status 2), never a default training run.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

PROG = "python -m mok"
COMMANDS = {
    "train": "train a small mixture-of-experts language model with mok.nn.MoE (the main job)",
    "demo": "one forward and backward of the fused layer, checked against the reference",
    "bench": "the layer benchmark (--ep N: expert parallel); runs from a source checkout",
}
USAGE_ERROR = 2  # argparse's exit status for a bad command line


def usage() -> str:
    """The top-level help: the commands, one line each, and how to get a command's options."""
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in COMMANDS.items()]
    lines += ["", f"`{PROG} COMMAND --help` shows the options of a command, e.g. "
                  f"`{PROG} train --help`."]
    return "\n".join(lines)


def _usage_error(message: str) -> SystemExit:
    print(f"{PROG}: error: {message}; commands: {', '.join(COMMANDS)} "
          f"(`{PROG} --help` describes them)", file=sys.stderr)
    return SystemExit(USAGE_ERROR)


def demo(argv: list[str]) -> None:
    """`python -m mok demo`: one fused forward and backward, checked against the reference."""
    from mok.app.train import int_at_least, seed_value

    parser = argparse.ArgumentParser(prog=f"{PROG} demo")
    parser.add_argument("--tokens", type=int_at_least(1), default=256)
    # The kernels move rows of 16 bytes: hidden and intermediate sizes are multiples of 8.
    parser.add_argument("--hidden", type=int_at_least(8, multiple_of=8), default=128)
    parser.add_argument("--intermediate", type=int_at_least(8, multiple_of=8), default=64)
    parser.add_argument("--experts", type=int_at_least(1), default=8)
    parser.add_argument("--topk", type=int_at_least(1), default=2)
    parser.add_argument("--shared", type=int_at_least(0, multiple_of=8), default=64,
                        help="shared expert's intermediate size (0: none)")
    parser.add_argument("--seed", type=seed_value, default=0)
    args = parser.parse_args(argv)
    if args.topk > args.experts:
        parser.error(f"--topk {args.topk} exceeds --experts {args.experts}")

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
    kept = "the gate/up pre-activations" if context.gate_up is not None else "h"
    print(f"saved for backward: {context.nbytes / 2**20:.2f} MiB ({kept})")
    y_ref, grads_ref = moe_reference_grads(inputs, compute_dtype=torch.float32)
    print("against the mok.testing reference (fp32):")
    for name, actual, expected in zip(("y", *GRAD_NAMES), (y, *grads), (y_ref, *grads_ref),
                                      strict=True):
        if expected is not None:
            print("  " + str(assert_close(actual, expected, dtype=inputs.x.dtype, name=name)))
    print("ok")


def bench(argv: list[str]) -> None:
    """`python -m mok bench`: the layer benchmark, or with --ep the expert-parallel one."""
    expert_parallel = any(arg == "--ep" or arg.startswith("--ep=") for arg in argv)
    try:
        from benchmarks import ep, layer
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "benchmarks":
            raise SystemExit(
                "mok bench: the benchmarks ship with mok's source repository, not with the "
                "installed package: run it from the root of a clone (cd mok && python -m mok "
                "bench)") from None
        # benchmarks/ is there but one of its imports is not.
        raise SystemExit(f"mok bench: cannot import the benchmarks ({exc})") from None
    (ep if expert_parallel else layer).main(argv)


def main(argv: list[str] | None = None) -> None:
    """Run `python -m mok COMMAND ...` with argv (default: the process's arguments)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    command, rest = argv[0], argv[1:]
    if command.startswith("-"):
        raise _usage_error(f"{command} comes before any command")
    if command not in COMMANDS:
        raise _usage_error(f"unknown command {command!r}")
    try:
        if command == "train":
            from mok.app import train

            train.main(rest)
        elif command == "demo":
            demo(rest)
        else:
            bench(rest)
    except KeyboardInterrupt:
        # Ctrl-C outside a training loop (which saves and exits by itself): no traceback.
        print(f"mok {command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
