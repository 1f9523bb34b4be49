"""Which model entry of the configuration applies to a request's `model` name."""

from __future__ import annotations

import fnmatch

from kvgate.config import Config, ModelConfig

_CACHE_LIMIT = 4096


class ModelMatcher:
    """Exact names first, then globs in file order, then the default entry.

    Lookups are cached; the cache is bounded because model names come from clients.
    """

    def __init__(self, config: Config) -> None:
        self._default = config.default_model
        self._exact = {m.match: m for m in reversed(config.models) if not _is_glob(m.match)}
        self._globs = tuple(m for m in config.models if _is_glob(m.match))
        self._cache: dict[str | None, ModelConfig] = {}

    def lookup(self, model: str | None) -> ModelConfig:
        found = self._cache.get(model)
        if found is None:
            found = self._match(model)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[model] = found
        return found

    def _match(self, model: str | None) -> ModelConfig:
        if model is None:
            return self._default
        exact = self._exact.get(model)
        if exact is not None:
            return exact
        for entry in self._globs:
            if fnmatch.fnmatchcase(model, entry.match):
                return entry
        return self._default


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")
