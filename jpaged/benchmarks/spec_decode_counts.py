"""Speculative decoding's counters as a serving benchmark reads them: scraped from the server's /metrics before and
after the run (vLLM's spec_decode names, under jpaged's `jpaged:` prefix or vLLM's `vllm:`), so `jpaged bench
serve` reports the run's acceptance against either server, as `vllm bench serve` does."""

from __future__ import annotations

from dataclasses import dataclass, field

NAMES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecDecodeCounts:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: tuple[float, ...] = field(default=())

    def __sub__(self, before: SpecDecodeCounts) -> SpecDecodeCounts:
        positions = len(self.accepted_per_position)
        earlier = (*before.accepted_per_position, *(0.0,) * positions)[:positions]
        return SpecDecodeCounts(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            tuple(a - b for a, b in zip(self.accepted_per_position, earlier, strict=True)),
        )

    def report(self) -> list[str]:
        """vllm bench serve's speculative decoding rows (the acceptance length counts the bonus token)."""
        drafts = self.num_drafts or 1.0
        rate = 100.0 * self.num_accepted_tokens / (self.num_draft_tokens or 1.0)
        rows = [
            ("Acceptance rate (%):", rate),
            ("Acceptance length:", 1.0 + self.num_accepted_tokens / drafts),
            ("Drafts:", int(self.num_drafts)),
            ("Draft tokens:", int(self.num_draft_tokens)),
            ("Accepted tokens:", int(self.num_accepted_tokens)),
        ]
        lines = ["{s:{c}^50}".format(s="Speculative Decoding", c="-")]
        lines += [f"{n:<40}{v:<10.2f}" if isinstance(v, float) else f"{n:<40}{v:<10}" for n, v in rows]
        per_position = ", ".join(f"{100.0 * a / drafts:.1f}" for a in self.accepted_per_position)
        lines.append(f"{'Per-position acceptance (%):':<40}{per_position}")
        return lines


def parse_counts(text: str) -> SpecDecodeCounts | None:
    """The spec_decode counters in a Prometheus text exposition; None when the server exposes none (it does
    not speculate)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    positions: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1].removesuffix("_total")
            if name == PER_POSITION:
                position = int(sample.labels["position"])
                positions[position] = positions.get(position, 0.0) + sample.value
            elif name in NAMES:
                values[name] = values.get(name, 0.0) + sample.value
    if not values:
        return None
    per_position = tuple(positions[p] for p in sorted(positions))
    return SpecDecodeCounts(*(values.get(name, 0.0) for name in NAMES), per_position)


def scrape(base_url: str) -> SpecDecodeCounts | None:
    """The server's counters now; None where it has no /metrics or no spec_decode counters."""
    import httpx

    try:
        response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return parse_counts(response.text) if response.status_code == 200 else None
