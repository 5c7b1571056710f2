"""Prompts of ``hybridkv run``: reading ``--prompts`` files and checking every prompt.

Files are UTF-8 text, gzip-compressed or not (recognised by their first bytes), one prompt per
line: text when the model has a tokenizer, else whitespace-separated token ids.  Every problem
is a one-line :class:`RunInputError` naming the file (and line) and what is expected, raised
before the model is loaded.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVError

__all__ = [
    "DEFAULT_REQUESTS",
    "MAX_MODEL_LEN_CAP",
    "RunInputError",
    "prompt_lines",
    "prompts_for",
    "read_prompts",
]

#: Generated prompts when neither ``--prompts`` nor ``--num-requests`` is given.
DEFAULT_REQUESTS = 8
#: ``--max-model-len`` default cap: hybridkv.engine.llm_engine.DEFAULT_MAX_MODEL_LEN (which
#: imports torch, so it is repeated here).
MAX_MODEL_LEN_CAP = 2048
_PROMPT_FILE = "a text file, one prompt per line (plain or gzip-compressed)"


class RunInputError(HybridKVError, ValueError):
    """A bad ``hybridkv run`` option or prompt file."""


def prompt_lines(path: str) -> list[str]:
    """The lines of a UTF-8 text file, read through gzip when it starts with gzip's magic
    bytes; :class:`RunInputError` naming the file and what is expected otherwise."""
    import gzip
    import zlib

    if not path.strip():
        raise RunInputError(f"--prompts: got an empty name; give {_PROMPT_FILE}")
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise RunInputError(f"--prompts: {path!r} does not exist; give {_PROMPT_FILE}") from None
    except IsADirectoryError:
        raise RunInputError(f"--prompts: {path!r} is a directory; give {_PROMPT_FILE}") from None
    except OSError as exc:
        raise RunInputError(
            f"--prompts: cannot read {path!r} ({exc.strerror}); give {_PROMPT_FILE}"
        ) from None
    what = repr(path)
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise RunInputError(
                f"--prompts: {path!r} is a broken gzip file ({exc}); give {_PROMPT_FILE}"
            ) from None
        what = f"{path!r} (gzip, decompressed)"
    nul = data.find(b"\x00")
    if nul >= 0:
        raise RunInputError(
            f"--prompts: {what} is not UTF-8 text (a NUL byte at byte {nul}: binary, or "
            f"UTF-16); give {_PROMPT_FILE}"
        )
    try:
        return data.decode("utf-8-sig").splitlines()  # a leading byte-order mark dropped
    except UnicodeDecodeError as exc:
        raise RunInputError(
            f"--prompts: {what} is not UTF-8 text (byte {exc.start}); give {_PROMPT_FILE}"
        ) from None


#: A token id as a prompt file spells it: ASCII digits (``str.isdigit`` also takes "²" and
#: "١", which ``int`` refuses or reads), at most 19 of them, optionally negative (the engine
#: names a negative id itself).
_TOKEN_ID = re.compile(r"-?[0-9]{1,19}")


def _numbered_prompts(path: str, lines: list[str], tokenizer: Any) -> list[tuple[int, list[int]]]:
    """``(line number, token ids)`` of every non-blank line of prompt file ``path``, whose
    ``lines`` :func:`prompt_lines` read."""
    prompts: list[tuple[int, list[int]]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if tokenizer is not None:
            prompts.append((number, list(tokenizer(line)["input_ids"])))
            continue
        words = line.split()
        bad = next((t for t in words if not _TOKEN_ID.fullmatch(t)), None)
        if bad is not None:
            shown = bad if len(bad) <= 40 else bad[:37] + "..."
            raise RunInputError(
                f"--prompts: {path}:{number}: {shown!r} is not a token id; the model has no "
                "tokenizer, so each line must hold whitespace-separated integer token ids "
                "(ASCII digits, at most 19)"
            )
        prompts.append((number, [int(t) for t in words]))
    if not prompts:
        raise RunInputError(f"--prompts: {path!r} holds no prompt; give {_PROMPT_FILE}")
    return prompts


def read_prompts(path: str, tokenizer: Any) -> list[list[int]]:
    """Prompts of ``path`` (UTF-8 text, optionally gzip-compressed), one per non-blank line:
    encoded text with ``tokenizer``, else whitespace-separated token ids.  Raises
    :class:`RunInputError` naming the file (and line) for a missing, unreadable, binary or
    empty file or a line that is not token ids."""
    return [ids for _, ids in _numbered_prompts(path, prompt_lines(path), tokenizer)]


def prompts_for(
    args: argparse.Namespace,
    lines: list[str] | None,
    tokenizer: Any,
    *,
    vocab_size: int,
    max_model_len: int,
) -> list[list[int]]:
    """The requests' prompts (the ``lines`` of ``--prompts``, or generated), every one checked
    against the model's vocabulary and ``max_model_len`` before anything is loaded."""
    from hybridkv.engine.demo import SUFFIX_KINDS, shared_prefix_prompts, suffix_length
    from hybridkv.engine.llm_engine import prompt_problem

    limits = {"vocab_size": vocab_size, "max_model_len": max_model_len}
    length_hint = (
        f"--max-model-len {args.max_model_len}"
        if args.max_model_len is not None
        else f"max_model_len {max_model_len} (the model's limit, at most {MAX_MODEL_LEN_CAP})"
    )
    if lines is None:
        n = args.num_requests or DEFAULT_REQUESTS
        # checked before generating: a huge prefix would build a huge list first
        longest = args.shared_prefix + suffix_length(min(n, SUFFIX_KINDS) - 1)
        if longest >= max_model_len:
            room = max_model_len - 1 - (longest - args.shared_prefix)  # one output token
            fix = f"lower --shared-prefix to at most {room}" if room >= 0 else "lower it"
            if args.max_model_len is not None:  # not the model's own limit: it may grow
                fix += " or raise --max-model-len"
            raise RunInputError(
                f"--shared-prefix {args.shared_prefix}: the generated prompts have up to "
                f"{longest} tokens (the shared prefix + their own), too long for "
                f"{length_hint}; {fix}"
            )
        return shared_prefix_prompts(
            n, vocab_size=vocab_size, shared_prefix=args.shared_prefix, seed=args.seed
        )
    numbered = _numbered_prompts(args.prompts, lines, tokenizer)
    for number, ids in numbered:
        problem = prompt_problem(ids, **limits)
        if problem is None:
            continue
        if len(ids) >= max_model_len:
            problem = (
                f"the prompt has {len(ids)} tokens, too long for {length_hint}; prompts must "
                "leave room for an output token: shorten it or raise --max-model-len"
            )
        raise RunInputError(f"--prompts: {args.prompts}:{number}: {problem}")
    n = args.num_requests or len(numbered)
    return [numbered[i % len(numbered)][1] for i in range(n)]
