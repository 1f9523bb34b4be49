"""Fetch the local engine's /metrics page: the I/O half of `engine_metrics`.

One aiohttp session for the agent's lifetime (a connection kept alive to the engine), and a total
timeout well under the sampling period, so a slow engine costs one stale sample, not a late stream.
"""

from __future__ import annotations

import aiohttp

from kvgate.errors import HeadroomError
from kvgate.headroom.engine_metrics import EngineStats, parse_engine_metrics


class EngineScraper:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def scrape(self) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.get(self.url) as response:
                if response.status != 200:
                    raise HeadroomError(f"engine metrics {self.url}: HTTP {response.status}")
                # Prometheus text is UTF-8 by spec; decoding directly skips aiohttp's charset sniffing.
                return (await response.read()).decode("utf-8", errors="replace")
        except TimeoutError as exc:
            raise HeadroomError(
                f"engine metrics {self.url}: no answer within {self._timeout.total}s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise HeadroomError(f"engine metrics {self.url}: {exc}") from exc

    async def sample(self) -> EngineStats:
        return parse_engine_metrics(await self.scrape())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
