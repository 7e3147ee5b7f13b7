"""Checks of ``--data`` and the example options before any rank starts."""

from __future__ import annotations

from zero3_offload.data.source import find_source
from zero3_offload.errors import InputError
from zero3_offload.train.options import TrainOptions
from zero3_offload.train.sources import OptionError

__all__ = ["check_data"]

# Options that only apply to examples, and their defaults.
_EXAMPLE_OPTIONS = {
    "eval_data": None,
    "data_format": "auto",
    "data_field": None,
    "loss_on": "assistant",
    "pack": False,
    "bad_records": "fail",
}


def check_data(opts: TrainOptions) -> None:
    """Refuse a ``--data`` that does not exist, examples without ``--model``, and example
    options (``--pack``, ``--loss-on``, ``--eval-data`` ...) for a text stream.

    Raises:
        OptionError: naming the flag and what is wrong.
    """
    structured = False
    if opts.data is not None:
        try:
            structured = find_source(opts.data).structured
        except InputError as exc:
            raise OptionError(f"--data {exc}") from None
    if structured and opts.model is None:
        raise OptionError(
            f"--data {opts.data}: examples (records or a dataset) need --model DIR, a "
            "transformers causal LM with its tokenizer; the built-in GPT trains on text"
        )
    if not structured:
        given = [
            "--" + name.replace("_", "-")
            for name, default in _EXAMPLE_OPTIONS.items()
            if getattr(opts, name) != default
        ]
        if given:
            raise OptionError(
                f"{', '.join(given)}: only for examples (a .jsonl, .json, .parquet or .csv "
                "file, a directory of them, or a datasets directory in --data); "
                f"--data is {'text' if opts.data else 'not given (the stdlib text)'}"
            )
