"""Command-line pieces shared by the bench and the scripts in ``benchmarks/``: argument types
that reject a bad value in one line naming it and the limit, and a help formatter that gives
every option's default. Stdlib only (``--help`` and usage errors import nothing heavy)."""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, Callable, List

__all__ = ["SHARDINGS", "HelpFormatter", "plain_text", "int_at_least", "float_above", "float_at_least", "float_in",
           "comma_list", "checked", "depth_pairs"]

#: ``planning.SHARDING_TYPES`` + ``auto`` (kept here so that ``--help`` and usage errors need
#: no TorchRec import; tests/test_bench_cli.py checks that the two agree).
SHARDINGS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "auto")


_ROLE = re.compile(r":[a-z]+:`(~?)([^`<]*?)(?:\s*<[^>]*>)?`")


def _role(m: "re.Match[str]") -> str:
    text = m.group(2)
    return text.rsplit(".", 1)[-1] if m.group(1) else text


def plain_text(text: str) -> str:
    """A docstring's reStructuredText as plain text for a terminal (``--help``): inline
    literals and roles lose their markup (a ``~`` target keeps its last part), emphasis its
    stars, a literal block's ``::`` becomes ``:`` (or goes, after a space); the layout stays."""
    text = _ROLE.sub(_role, text)
    text = re.sub(r"``(.+?)``", r"\1", text, flags=re.S)
    text = re.sub(r"(?<![\w*])\*\*([^*\n]+)\*\*(?![\w*])", r"\1", text)
    text = re.sub(r"(?<![\w*])\*([A-Za-z][^*\n]*)\*(?![\w*])", r"\1", text)
    text = re.sub(r"\s::$", "", text, flags=re.M)
    return re.sub(r"::$", ":", text, flags=re.M)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every option's help; an option whose help already explains its default
    (``None`` meaning "computed") is left as written. Descriptions and epilogs keep their
    layout and lose their reStructuredText markup (:func:`plain_text`)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(plain_text(text), width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None and "default" in text:
            return text
        return super()._get_help_string(action)


def checked(kind: str, test: Callable[[Any], bool], convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(s: str) -> Any:
        try:
            v = convert(s)
        except ValueError:
            v = None
        if v is None or not test(v):
            raise argparse.ArgumentTypeError(f"invalid value {s!r}: expected {kind}")
        return v

    parse.__name__ = kind  # argparse names the type in some messages
    return parse


def _finite(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(s)
    return v


def int_at_least(lo: int) -> Callable[[str], int]:
    return checked(f"an integer >= {lo}", lambda v: v >= lo, int)


def float_above(lo: float) -> Callable[[str], float]:
    return checked(f"a number > {lo:g}", lambda v: v > lo, _finite)


def float_at_least(lo: float) -> Callable[[str], float]:
    return checked(f"a number >= {lo:g}", lambda v: v >= lo, _finite)


def float_in(lo: float, hi: float) -> Callable[[str], float]:
    return checked(f"a number in ({lo:g}, {hi:g}]", lambda v: lo < v <= hi, _finite)


def comma_list(item: Callable[[str], Any], kind: str) -> Callable[[str], List[Any]]:
    def parse(s: str) -> List[Any]:
        items = s.split(",")
        for x in items:
            try:
                item(x.strip())
            except argparse.ArgumentTypeError:
                raise argparse.ArgumentTypeError(f"invalid value {s!r}: expected comma-separated {kind} "
                                                 f"(item {x.strip()!r})") from None
        return [item(x.strip()) for x in items]

    return parse


def _depth_pair(s: str) -> tuple:
    k, _, kd = s.partition(":")
    pair = (int(k), int(kd) if kd else int(k))
    if pair[0] < 1 or pair[1] < pair[0]:
        raise ValueError(s)
    return pair


#: ``--ssd-depths``: ``K:KD`` items (host->device depth K >= 1, disk depth KD >= K; ``K``
#: alone is ``K:K``).
depth_pairs = comma_list(checked("K:KD with 1 <= K <= KD", lambda v: True, _depth_pair),
                         "K:KD pairs with 1 <= K <= KD")
