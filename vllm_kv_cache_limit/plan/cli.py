"""``vllm-kv-plan``: the command line, with vLLM's option names and defaults.

    vllm-kv-plan MODEL [--max-model-len N] [--concurrency C]
                       [--tensor-parallel-size TP] [--pipeline-parallel-size PP]
                       [--kv-cache-dtype D] [--block-size B] [--dtype D]
                       [--max-num-batched-tokens N]
                       [--kv-cache-max-memory SIZE] [--json]

Bad input ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from vllm_kv_cache_limit.logic.cap_decision import FLAG
from vllm_kv_cache_limit.logic.sizes import argparse_size, parse_count
from vllm_kv_cache_limit.plan.arithmetic import make_plan
from vllm_kv_cache_limit.plan.errors import EXIT_ERROR, PROG, PlanError, first_line
from vllm_kv_cache_limit.plan.introspect import check_choices, check_model_source, load_model_kv_cache, quiet_vllm
from vllm_kv_cache_limit.plan.report import as_json, format_human


def _positive_int(name: str) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = parse_count(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be a whole number such as 8, 4096 or 32k, got {value!r}"
            ) from None
        if number < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value!r}")
        return number

    parse.__name__ = name
    return parse


def _add_count(parser: argparse.ArgumentParser, *flags: str, default: int | None, help: str) -> None:
    """A whole-number option of at least 1, read as vLLM reads counts; its
    errors name the option (its last flag)."""
    parser.add_argument(*flags, type=_positive_int(flags[-1]), default=default, help=help)


def _size_arg(value: str) -> str:
    """A size, checked as ``--kv-cache-max-memory`` checks it, kept as typed
    (the report quotes it)."""
    argparse_size(value)
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line, with vLLM's option names and defaults."""
    parser = _Parser(
        prog=PROG,
        description=(
            "How much KV cache memory a vLLM model needs per device, computed with vLLM's own "
            "KV cache planning, and the --kv-cache-max-memory to pass. Offline: MODEL is a "
            "local folder or a model id already in the Hugging Face cache; no weights are loaded."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="model folder, or model id in the local Hugging Face cache")
    _add_count(
        parser,
        "--max-model-len",
        default=None,
        help="tokens per request (prompt + output); default: the model's own, as vLLM derives it",
    )
    _add_count(
        parser,
        "--concurrency",
        default=1,
        help="requests of max-model-len tokens that must fit at once (default: 1)",
    )
    _add_count(
        parser,
        "-tp",
        "--tensor-parallel-size",
        default=1,
        help="tensor parallel size (default: 1); all sizes are per device",
    )
    _add_count(
        parser,
        "-pp",
        "--pipeline-parallel-size",
        default=1,
        help="pipeline parallel size (default: 1)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache data type, as vLLM's --kv-cache-dtype (default: auto, the model's dtype on this platform)",
    )
    _add_count(
        parser,
        "--block-size",
        default=None,
        help="tokens per KV cache block; default: the platform's (128 on the CPU backend)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="model data type, as vLLM's --dtype (default: auto)",
    )
    _add_count(
        parser,
        "--max-num-batched-tokens",
        default=None,
        help="scheduler budget per step; sliding-window layers keep this many extra tokens "
        "(default: vLLM's default for `vllm serve`; LLM(...) uses a larger one)",
    )
    parser.add_argument(
        FLAG,
        dest="kv_cache_max_memory",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="also answer the reverse question: the blocks, tokens and concurrency this cap gives",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="as vLLM's --trust-remote-code")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("-v", "--verbose", action="store_true", help="keep vLLM's own log lines")
    return parser


def run(args: argparse.Namespace) -> str:
    """Plan and return the text to print."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    check_model_source(args.model)
    with quiet_vllm(args.verbose):
        check_choices(args)
        kv = load_model_kv_cache(args)
        plan = make_plan(kv, args.concurrency, args.kv_cache_max_memory)
    if args.json:
        return json.dumps(as_json(plan), indent=2)
    return format_human(plan)


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``vllm-kv-plan``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        output = run(args)
    except PlanError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        if args.verbose:
            raise
        print(
            f"{PROG}: error: unexpected {type(exc).__name__}: {first_line(exc)} (--verbose shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    try:
        print(output, flush=True)
    except BrokenPipeError:  # e.g. `vllm-kv-plan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
