"""Node telemetry: scrape each node's vLLM ``/metrics`` and keep the latest sample.

``parse`` turns one page into a :class:`~regional_agent.telemetry.parse.Scrape` (pure, both
generations of vLLM's names); ``scraper.Scraper`` runs the scrape loop and answers
``snapshot(node_id, now=...)`` for ``NodePool.views``: ``None`` when the node's telemetry is
unknown (never scraped, or stale).
"""

from regional_agent.telemetry.parse import Scrape, TelemetryError
from regional_agent.telemetry.scraper import Scraper

__all__ = ["Scrape", "Scraper", "TelemetryError"]
