"""Graphics cards by memory size, for planning without the card (`plan --card 24gb` on a laptop or a CPU machine):
the memory each size reports to CUDA (nvidia-smi's "total", MiB), which the planner takes as the budget."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Card:
    """A card size: its name on the command line, the memory it reports (MiB) and example cards."""

    name: str
    mib: int
    examples: str


CARDS: dict[str, Card] = {c.name: c for c in (
    Card("12gb", 12_288, "RTX 3060 12 GB, RTX 4070, RTX 5070"),
    Card("16gb", 16_376, "RTX 4060 Ti 16 GB, RTX 4080, RTX 5080"),
    Card("24gb", 24_564, "RTX 3090, RTX 4090"),
    Card("32gb", 32_607, "RTX 5090"),
    Card("48gb", 49_140, "RTX A6000, RTX 6000 Ada, L40S"),
    Card("80gb", 81_559, "A100 80 GB, H100 80 GB"),
    Card("141gb", 143_771, "H200"),
)}


def card_budget_mib(name: str) -> int:
    """The planning budget (MiB) of the card size `name` ("24gb"; "24", "24g" and "24GB" are accepted too);
    ValueError listing the sizes for any other name."""
    key = name.strip().lower().removesuffix("b").removesuffix("g") + "gb"
    if key not in CARDS:
        raise ValueError(f"unknown card {name!r}: choose one of {', '.join(CARDS)}")
    return CARDS[key].mib


def cards_help() -> str:
    """The card sizes and examples, one per line (for --help)."""
    return "\n".join(f"  {c.name:>6}  {c.mib:>7,} MiB  {c.examples}" for c in CARDS.values())
