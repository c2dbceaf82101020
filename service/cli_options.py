"""Options that several ``batchasr`` commands share (transcribe, submit, jobs): their help, their parsing, the
subtitle layout they ask for."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .formats import SubtitleLayout

MULTICHANNEL_HELP = ("transcribe each channel apart (a call's agent and customer) and give each file as a "
                     "conversation: utterances in time order, each naming its channel")
CHANNEL_NAMES_HELP = "with --multichannel: the speakers, one a channel in order (e.g. agent,customer)"
SKIP_SILENCE_HELP = ("leave out quiet stretches of 2 s or more (near the recording's noise floor): they cost nothing "
                     "and give no words")
HOTWORDS_HELP = ("comma-separated words or phrases to make likelier, as the model writes them (product names, "
                 "people); 'acme:3' gives one its own bonus (others: 2.0, or a server's BATCHASR_HOTWORD_BOOST)")


def phrases(text: str) -> list[str]:
    """Hotwords, checked as far as they can be without the model (a job written straight into Redis was queued,
    and each of its items failed on them)."""
    from models.tokenizer import checked_hotwords

    from .hotwords import split_hotwords

    found = split_hotwords([text])
    try:
        checked_hotwords(found)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return found


def names(text: str) -> list[str]:
    from models.conversation import parse_names

    try:
        return parse_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_layout_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-line-width", type=int, metavar="CHARS",
                   help="srt, vtt: characters a subtitle line holds at most (default 42)")
    p.add_argument("--max-line-count", type=int, metavar="LINES",
                   help="srt, vtt: lines a subtitle cue holds at most (default 2)")


def layout(args: argparse.Namespace) -> SubtitleLayout:
    """The subtitle layout the options ask for; ValueError for one out of range."""
    from .formats import SubtitleLayout

    given = {"max_line_width": args.max_line_width, "max_line_count": args.max_line_count}
    return SubtitleLayout(**{name: value for name, value in given.items() if value is not None})
