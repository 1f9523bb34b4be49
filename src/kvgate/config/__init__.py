"""The kvgate YAML file: parsed and defaulted first, running objects built from it afterwards.

Every section is a frozen dataclass; the loader walks the YAML node tree against those dataclasses so
that an unknown key, a wrong type or an out-of-range value is reported with the file, the line and
the dotted key (`kvgate.yaml:12: models[0].max_total_tokens: must be >= 1, got -5`).
Model entries inherit every key they leave out from `default_model`.

This package is the floor every other one stands on: it imports only kvgate's plain modules (errors,
bounds, names, addresses, tls), never a package above it; the sections other packages read live here
(kvgate.config.headroom, kvgate.config.queue).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from kvgate.addresses import split_host_port
from kvgate.bounds import at_least
from kvgate.config.headroom import HeadroomSettings
from kvgate.config.queue import QueueSettings
from kvgate.config.routekeys import AsyncMode as AsyncMode
from kvgate.config.routekeys import bounds
from kvgate.errors import ConfigError
from kvgate.names import METADATA_NAMESPACE, PRIORITY_HEADER
from kvgate.tls import TlsConfig

MiB = 1024 * 1024
_V = typing.TypeVar("_V")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    listen: str = "127.0.0.1:9002"
    workers: int = field(default=1, metadata=at_least(1))
    # Envoy can buffer this much body; gRPC's 4 MiB default would refuse big prompts.
    max_message_bytes: int = field(default=64 * MiB, metadata=at_least(1 * MiB))
    drain_seconds: float = field(default=30.0, metadata=at_least(0))
    # Envoy dynamic-metadata namespace of the decision (pool, tokens, reason, endpoint, model); it
    # must be listed in the ext_proc filter's metadata_options.receiving_namespaces.untyped.
    metadata_namespace: str = METADATA_NAMESPACE
    # What the gate speaks to Envoy: `kvgate`, its own dialect (x-kvgate-pool and x-kvgate-endpoint,
    # matched by the route tables of envoy/envoy.yaml), or `endpoint-picker`, the Gateway API Inference
    # Extension's Endpoint Picker Protocol: an InferencePool's gateway asks it for the endpoint of
    # every request (kvgate.gate.picker, envoy/envoy-inferencepool.yaml).
    protocol: Literal["kvgate", "endpoint-picker"] = "kvgate"
    # As an endpoint picker, the most engines named for a request that reserves nothing: the pick, then
    # fallbacks an Envoy-based gateway tries in order. 1 for a gateway that takes one endpoint only
    # (agentgateway: a list is an error there, crates/agentgateway/src/http/ext_proc.rs @75b4e6ce).
    picker_endpoints: int = field(default=3, metadata={"min": 1, "max": 16})

    def __post_init__(self) -> None:
        # No port 0: the gate is found where its config says, by Envoy and by its own workers.
        split_host_port(self.listen, "server.listen")


@dataclass(frozen=True, slots=True)
class PoolNames:
    """The values of `x-kvgate-pool` that Envoy's routes match on."""

    interactive: str = "interactive"
    long: str = "long"
    async_: str = "async"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    match: str = "*"
    tokenizer: str | None = None
    # A request fits the interactive pool when prompt + output budget fits its max-model-len.
    interactive_max_tokens: int = field(default=4096, metadata=bounds("interactive_max_tokens"))
    max_total_tokens: int = field(default=16384, metadata=bounds("max_total_tokens"))
    # Budget charged when the client names none: charging the whole context would starve concurrency.
    default_output_tokens: int = field(default=1024, metadata=bounds("default_output_tokens"))
    image_tokens: int = field(default=1024, metadata=at_least(0))
    message_overhead_tokens: int = field(default=4, metadata=at_least(0))
    pools: PoolNames = PoolNames()
    # Long requests and the async pool: `prefer` sends them there at once, `allow` when no node has
    # room (instead of 429), `never` refuses them; unset follows admission.async_fallback.
    async_mode: AsyncMode | None = None

    def contradiction(self) -> str | None:
        """This entry's interactive limit above its total limit (see `limits_contradiction`)."""
        return limits_contradiction(self.interactive_max_tokens, self.max_total_tokens)

    def capped(self) -> ModelConfig:
        """The entry as the gate applies it once layers are combined: the total limit wins, and an
        interactive limit above it is lowered to it (no request can be longer than the total)."""
        if self.interactive_max_tokens <= self.max_total_tokens:
            return self
        return dataclasses.replace(self, interactive_max_tokens=self.max_total_tokens)


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """A named set of overrides (`policies:`) that an Envoy route or virtual host picks with
    `x-kvgate-model-policy`; a key left out keeps the request's model entry's value. Its keys and
    bounds are the route-policy table's (kvgate.config.routekeys)."""

    interactive_max_tokens: int | None = field(default=None, metadata=bounds("interactive_max_tokens"))
    max_total_tokens: int | None = field(default=None, metadata=bounds("max_total_tokens"))
    default_output_tokens: int | None = field(default=None, metadata=bounds("default_output_tokens"))
    async_mode: AsyncMode | None = None

    def contradiction(self) -> str | None:
        """This layer's own interactive limit above its own total limit (see `limits_contradiction`)."""
        return limits_contradiction(self.interactive_max_tokens, self.max_total_tokens)


def limits_contradiction(interactive: int | None, total: int | None) -> str | None:
    """The rule "interactive limit <= total limit", written once; None where it holds (or where one
    of the two is not set).

    One behaviour, by where the limits meet. Limits written together that contradict each other are
    refused where they are written: a kvgate.yaml model entry or `policies:` entry fails to load
    (naming its line; a model entry counts with what it inherits from default_model), and
    `kvgate envoy-config` (and the chart) refuse such a route policy. Limits from different layers
    (model entry, named policy, Envoy route) only meet per request, where nothing can be refused any
    more: there the total wins (`ModelConfig.capped`) and the gate reports the cap once per model
    and route (kvgate.policy.route.limits_capped). The total wins because it bounds what is admitted
    at all: no admitted request is longer than it, so an interactive limit above it never applies.
    """
    if interactive is None or total is None or interactive <= total:
        return None
    return f"interactive_max_tokens ({interactive}) must not exceed max_total_tokens ({total})"


@dataclass(frozen=True, slots=True)
class RequestConfig:
    max_body_bytes: int = field(default=32 * MiB, metadata=at_least(1))
    # Cap on a gzip body once inflated: a zip bomb gets a 413 instead of exhausting memory.
    max_decompressed_bytes: int = field(default=64 * MiB, metadata=at_least(1))
    # Bytes of large bodies being read (inflated, parsed) off the event loop at once: parsing holds
    # several times a body's size (8 concurrent 29 MiB bodies of a million content parts took one
    # worker to 1.49 GiB), so past this a large body is refused with 503 and Retry-After. One body
    # is always read when no other is, whatever its size.
    max_bytes_in_flight: int = field(default=96 * MiB, metadata=at_least(1))
    max_messages: int = field(default=10_000, metadata=at_least(1))
    # Nesting allowed in tool schemas, response formats and tool arguments.
    max_json_depth: int = field(default=64, metadata=at_least(2))
    # What to do with bodies the gate does not understand (unknown paths, non-JSON content types).
    unparsed: Literal["passthrough", "reject"] = "passthrough"


@dataclass(frozen=True, slots=True)
class WaterThresholds:
    """Rising thresholds of a pool's water level; a level falls only `hysteresis` below them.

    Only what the engines report (KV) and the agents' staleness raise a level: the gate's own line of
    waiting requests does not (see REMOVED_KEYS)."""

    # Engine-reported KV usage over its whole capacity (reservations stop at capacity x safety ratio).
    yellow_kv: float = field(default=0.85, metadata=at_least(0))
    red_kv: float = field(default=0.95, metadata=at_least(0))
    yellow_stale: float = field(default=0.25, metadata=at_least(0))
    red_stale: float = field(default=0.75, metadata=at_least(0))
    hysteresis: float = field(default=0.10, metadata=at_least(0))


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    # Client-chosen priority; names listed most important first. Unknown values get the default.
    priority_header: str = PRIORITY_HEADER
    priorities: tuple[str, ...] = ("high", "normal", "low")
    default_priority: str = "normal"
    # A long request that fits nowhere waits this long, in priority order, for a node to free up.
    max_wait_s: float = field(default=2.0, metadata=at_least(0))
    queue_size: int = field(default=64, metadata=at_least(1))
    # Past this event-loop lag, a long request is answered at once (503 gateway_overloaded with
    # Retry-After, or the async pool) rather than left for Envoy's message_timeout to fail open
    # (kvgate.gate.loop_lag).
    max_loop_lag_s: float = field(default=0.5, metadata=at_least(0.01))
    # Nodes whose headroom stream is stale: `probe` still asks their agent (it grants atomically from its
    # own data) after every fresh node; `exclude` never does.
    stale_nodes: Literal["probe", "exclude"] = "probe"
    # After the wait: hand the request to the async pool instead of answering 429.
    async_fallback: bool = False
    # A long request that would go to the async pool after max_wait_s is held in the gate instead, up
    # to max_hold_s in all: the gate extends Envoy's ext_proc deadline (override_message_timeout), which
    # Envoy honours up to its max_message_timeout (set it >= max_hold_s + 5 s). Only what outlives the
    # hold goes to the async pool. At or below max_wait_s: no holding (docs/operations.md, "Holding a
    # request in the gate").
    max_hold_s: float = field(default=30.0, metadata={"min": 0, "max": 3595})
    retry_after_s: int = field(default=2, metadata=at_least(1))
    # Retry-After of a long request refused for want of capacity: `forecast` answers when the agents
    # expect enough KV to free for it (later by up to retry_jitter of itself, within retry_after_min_s
    # .. retry_after_max_s; retry_after_s, jittered, when nothing can be forecast); `fixed` always
    # answers retry_after_s. The official SDKs do not retry past a Retry-After of 120 s.
    retry_after: Literal["forecast", "fixed"] = "forecast"
    retry_after_min_s: float = field(default=0.5, metadata=at_least(0))
    retry_after_max_s: float = field(default=60.0, metadata=at_least(0))
    retry_jitter: float = field(default=0.1, metadata=at_least(0))
    breaker_open_s: float = field(default=2.0, metadata=at_least(0))
    breaker_probes: int = field(default=2, metadata=at_least(1))
    water: WaterThresholds = WaterThresholds()

    @property
    def longest_wait_s(self) -> float:
        """The longest any long request waits in the gate: max_hold_s when the gate holds requests."""
        return max(self.max_wait_s, self.max_hold_s)


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """Where a long request goes among the nodes that fit it (kvgate.policy.nodes)."""

    # Send a prompt that begins as one a node holds to that node, and reserve there only what live
    # requests do not already hold (docs/operations.md, "Prefix-aware placement").
    prefix_affinity: bool = False
    # Estimated tokens of one prefix block, cut as block_tokens x 4 bytes of prompt text.
    block_tokens: int = field(default=256, metadata=at_least(16))
    # Blocks hashed per prompt: a longer prompt is matched on its first max_blocks blocks. At most
    # 8,000: a Reserve carries 8 bytes a block, and agents take messages of 64 KiB at most.
    max_blocks: int = field(default=1024, metadata={"min": 1, "max": 8000})
    # A node is favoured for what it holds only while its requests in flight are at most
    # load_bound x the pool's mean + 1. On the Mooncake replay (kvgate_prefix_on, first half at 6x,
    # one run each, 2026-12-05): 1.25 gave 3.57M prefix-hit tokens, 2 gave 3.73M and 4 gave 3.70M, long
    # TTFT p50 174, 174 and 179 ms. vllm-router 0.1.17's cache_aware balances load only when the
    # busiest worker has 64 requests more than the least busy and 1.5x its load (`vllm-router --help`:
    # --balance-abs-threshold, --balance-rel-threshold), which this replay's pool never reaches.
    load_bound: float = field(default=2.0, metadata=at_least(1))


@dataclass(frozen=True, slots=True)
class SoftPoolsConfig:
    """Roles instead of hard pools (docs/operations.md, "Soft pools"): what each node lends is its
    agent's to say (`kvgate agent --role interactive` and its limits); the gate only chooses whether
    long requests borrow."""

    # Long requests try the long pool's nodes first, then the interactive pool's nodes whose agents
    # lend (interactive_headroom), for at most what each lends.
    borrow: bool = True


@dataclass(frozen=True, slots=True)
class TokenQuotaConfig:
    """A tenant's long requests may take `tokens` (prompt + output) per `window_s`: a token bucket that
    holds `tokens` and refills them over the window (kvgate.policy.tenant_limits)."""

    tokens: int = 0
    window_s: float = field(default=60.0, metadata={"min": 1})

    def contradiction(self) -> str | None:
        return (
            "a quota needs tokens: the prompt + output tokens allowed per window, >= 1"
            if self.tokens < 1
            else None
        )


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant's settings (`fairness.tenants.NAME`), or a class of tenants that an Envoy route names
    (`fairness.classes.NAME`, the route's `tenant_class`). A field left out takes the next layer's:
    the tenant's own entry, then its route's class, then the `fairness.default_*` values."""

    # The tenant's share of contended long-pool service against the others' weights.
    weight: float | None = field(default=None, metadata={"min": 0.01})
    # The most of the long pool's admissible KV this tenant's reservations may hold while another
    # tenant's long requests wait.
    max_kv_share: float | None = field(default=None, metadata={"min": 0.01, "max": 1.0})
    quota: TokenQuotaConfig | None = None


@dataclass(frozen=True, slots=True)
class FairnessConfig:
    """Token-weighted fair shares between tenants where long requests wait for KV
    (kvgate.policy.fair_share): the gate's line of waiters is ordered, within a priority, by each
    tenant's weighted attained service, not by arrival."""

    enabled: bool = False
    # A request's cost: prompt tokens + output_weight x output tokens (VTC's input + 2 x output).
    output_weight: float = field(default=2.0, metadata=at_least(0))
    # The weight of a tenant `tenants` does not name.
    default_weight: float = field(default=1.0, metadata={"min": 0.01})
    # The caps of a tenant that names none (None: no cap). They apply whether or not `enabled` orders
    # the line.
    default_max_kv_share: float | None = field(default=None, metadata={"min": 0.01, "max": 1.0})
    default_quota: TokenQuotaConfig | None = None
    tenants: Mapping[str, TenantConfig] = field(default_factory=dict)
    # Settings an Envoy route or virtual host gives the tenants whose requests it carries, by name
    # (route key `tenant_class`, kvgate.config.routekeys): e.g. every tenant of a partner's virtual
    # host weighs 3. A tenant's own entry in `tenants` wins over its route's class, field by field.
    classes: Mapping[str, TenantConfig] = field(default_factory=dict)

    def weight(self, tenant: str, tenant_class: str | None = None) -> float:
        return self._layered(tenant, tenant_class, lambda t: t.weight, self.default_weight)

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        """A request's cost in tokens, before its tenant's weight."""
        return prompt_tokens + self.output_weight * output_tokens

    def max_kv_share(self, tenant: str, tenant_class: str | None = None) -> float | None:
        return self._layered(tenant, tenant_class, lambda t: t.max_kv_share, self.default_max_kv_share)

    def quota(self, tenant: str, tenant_class: str | None = None) -> TokenQuotaConfig | None:
        return self._layered(tenant, tenant_class, lambda t: t.quota, self.default_quota)

    def _layered(
        self,
        tenant: str,
        tenant_class: str | None,
        field_of: Callable[[TenantConfig], _V | None],
        default: _V,
    ) -> _V:
        """The tenant's own value, else its class's, else `default`."""
        for layer in (self.tenants.get(tenant), self.classes.get(tenant_class) if tenant_class else None):
            if layer is not None and (value := field_of(layer)) is not None:
                return value
        return default

    @property
    def limits_tenants(self) -> bool:
        """Whether any tenant has a cap: a quota or a most share of KV."""
        entries = (*self.tenants.values(), *self.classes.values())
        return (
            self.default_max_kv_share is not None
            or self.default_quota is not None
            or any(t.max_kv_share is not None or t.quota is not None for t in entries)
        )


@dataclass(frozen=True, slots=True)
class RefusalsConfig:
    # 413 is the field report's answer to a request past max_total_tokens; 400 with the same
    # `context_length_exceeded` code is what OpenAI, vLLM and Anthropic answer, so the official SDKs
    # raise BadRequestError for it.
    too_long_status: Literal[413, 400] = 413


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = ServerConfig()
    request: RequestConfig = RequestConfig()
    admission: AdmissionConfig = AdmissionConfig()
    placement: PlacementConfig = PlacementConfig()
    refusals: RefusalsConfig = RefusalsConfig()
    # Agents of the long-context pool: reservations and its water level.
    headroom: HeadroomSettings = field(default_factory=HeadroomSettings)
    # Agents of the interactive pool, if any: its water level, and, where they lend (soft_pools), room
    # for long requests.
    interactive_headroom: HeadroomSettings = field(default_factory=HeadroomSettings)
    soft_pools: SoftPoolsConfig = SoftPoolsConfig()
    fairness: FairnessConfig = FairnessConfig()
    default_model: ModelConfig = ModelConfig()
    models: tuple[ModelConfig, ...] = ()
    # Named overrides for Envoy routes and virtual hosts (x-kvgate-model-policy: NAME).
    policies: Mapping[str, ModelPolicy] = field(default_factory=dict)
    # TLS on the ext_proc listener (Envoy -> gate) and on the channels to agents; plaintext by default.
    tls: TlsConfig = field(default_factory=TlsConfig)
    # `kvgate queue`, the async pool's upstream: bounds, hold time, leases (kvgate.config.queue).
    queue: QueueSettings = field(default_factory=QueueSettings)
    source: str = "<defaults>"


# Keys kvgate.yaml took once and no longer does, by dotted path, each with why it went: a file that
# still sets one fails to load naming it, rather than loading as if the setting still applied.
_QUEUE_SIGNAL_GONE = (
    "removed: the gate's line of waiting requests no longer turns a pool yellow or red (it used to open "
    "the breaker and shed every normal request because of a line the gate itself holds); a pool's level "
    "now follows only the engines' KV usage and stale agents, and the line overflows one request at a "
    "time by admission.queue_size (queue_full) and admission.max_wait_s (no_capacity). Delete this key "
    '(docs/operations.md, "Shedding")'
)
REMOVED_KEYS: Mapping[str, str] = {
    "admission.water.yellow_queue": _QUEUE_SIGNAL_GONE,
    "admission.water.red_queue": _QUEUE_SIGNAL_GONE,
}

# YAML keys that are Python keywords map onto a trailing-underscore field.
_KEY_ALIASES = {"async": "async_"}


def _yaml_key(name: str) -> str:
    return name[:-1] if name.endswith("_") else name


class _Loader:
    def __init__(self, source: str, default_min: float | None = None) -> None:
        self.source = source
        # Lower bound for numbers whose field sets none (a scenario's numbers are all >= 0).
        self.default_min = default_min

    def fail(self, node: yaml.Node, where: str, message: str) -> ConfigError:
        line = node.start_mark.line + 1
        prefix = f"{where}: " if where else ""
        return ConfigError(f"{self.source}:{line}: {prefix}{message}")

    def build(self, cls: type[Any], node: yaml.Node, where: str, base: Any = None) -> Any:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, where, f"expected a mapping, got {_describe(node)}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
        values: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            name = _KEY_ALIASES.get(key, key)
            path = f"{where}.{key}" if where else key
            if path in REMOVED_KEYS:
                raise self.fail(key_node, path, REMOVED_KEYS[path])
            if name not in fields or (name.endswith("_") and key == name):
                known = ", ".join(sorted(_yaml_key(n) for n in fields))
                raise self.fail(key_node, path, f"unknown key (known keys: {known})")
            if name in values:
                raise self.fail(key_node, path, "key given twice")
            values[name] = self.convert(hints[name], value_node, path, fields[name].metadata)
        if base is not None:
            for name in fields:
                values.setdefault(name, getattr(base, name))
        try:
            built = cls(**values)
        except ConfigError as exc:
            raise self.fail(node, where, str(exc)) from exc
        # A section whose values contradict each other says so (ModelConfig, ModelPolicy).
        contradiction = getattr(built, "contradiction", None)
        problem = contradiction() if contradiction is not None else None
        if problem is not None:
            raise self.fail(node, where, problem)
        return built

    def convert(self, hint: Any, node: yaml.Node, where: str, metadata: Any) -> Any:
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
                return None
            (inner,) = [a for a in args if a is not type(None)]
            return self.convert(inner, node, where, metadata)
        if dataclasses.is_dataclass(hint):
            return self.build(hint, node, where)  # type: ignore[arg-type]
        if origin is Mapping:
            if not isinstance(node, yaml.MappingNode):
                raise self.fail(node, where, f"expected a mapping, got {_describe(node)}")
            found: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = self.convert(str, key_node, where, {})
                if key in found:
                    raise self.fail(key_node, f"{where}.{key}", "key given twice")
                found[key] = self.convert(args[1], value_node, f"{where}.{key}", metadata)
            # A plain dict: the config is pickled to every gate worker process (mappingproxy is not).
            return found
        if origin is tuple:
            if not isinstance(node, yaml.SequenceNode):
                raise self.fail(node, where, f"expected a list, got {_describe(node)}")
            return tuple(
                self.convert(args[0], item, f"{where}[{i}]", metadata) for i, item in enumerate(node.value)
            )
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, where, f"expected a single value, got {_describe(node)}")
        value = yaml.safe_load(yaml.serialize(node))
        if origin is Literal:
            if value not in args:
                raise self.fail(node, where, f"must be one of {', '.join(map(str, args))}, got {value!r}")
            return value
        return self.scalar(hint, value, node, where, metadata)

    def scalar(self, hint: Any, value: Any, node: yaml.Node, where: str, metadata: Any) -> Any:
        if hint is bool:
            if not isinstance(value, bool):
                raise self.fail(node, where, f"expected true or false, got {value!r}")
            return value
        if hint is int or hint is float:
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (hint is int and not isinstance(value, int))
            ):
                raise self.fail(
                    node, where, f"expected {'an integer' if hint is int else 'a number'}, got {value!r}"
                )
            minimum = metadata.get("min", self.default_min)
            if minimum is not None and value < minimum:
                raise self.fail(node, where, f"must be >= {minimum:g}, got {value!r}")
            maximum = metadata.get("max")
            if maximum is not None and value > maximum:
                raise self.fail(node, where, f"must be <= {maximum:.15g}, got {value!r}")
            return hint(value)
        if hint is str:
            if not isinstance(value, str) or not value:
                raise self.fail(node, where, f"expected a non-empty string, got {value!r}")
            return value
        raise AssertionError(f"config field type {hint!r} has no converter")


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value)


T = typing.TypeVar("T")


def _compose(text: str, source: str) -> yaml.Node | None:
    """The document's node tree. A syntax error is named by its file and line like every other
    configuration error: PyYAML's own text calls the file "<unicode string>"."""
    try:
        return yaml.compose(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}: column {mark.column + 1}" if mark is not None else source
        what = "; ".join(part for part in (exc.context, exc.problem) if part)
        raise ConfigError(f"{where}: not valid YAML: {what}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc


def parse_yaml_as(cls: type[T], text: str, source: str, default_min: float | None = None) -> T:
    """Any YAML document read into the dataclass `cls` with kvgate.yaml's checks and messages
    (unknown keys, types, bounds, each named with its line). Used for the demo's scenario files."""
    root = _compose(text, source)
    if root is None:
        return cls()
    built: T = _Loader(source, default_min).build(cls, root, "")
    return built


def parse_config(text: str, source: str = "<string>") -> Config:
    """Parse and default a kvgate YAML document. Raises ConfigError naming the line and key."""
    root = _compose(text, source)
    if root is None:
        return Config(source=source)
    loader = _Loader(source)
    if not isinstance(root, yaml.MappingNode):
        raise loader.fail(root, "", f"the file must be a mapping of sections, got {_describe(root)}")
    sections = {key.value: (key, value) for key, value in root.value}
    default_node = sections.pop("default_model", None)
    models_node = sections.pop("models", None)
    base = yaml.MappingNode(
        "tag:yaml.org,2002:map", [item for item in root.value if item[0].value in sections]
    )
    base.start_mark = root.start_mark
    config: Config = loader.build(Config, base, "")
    default_model = ModelConfig()
    if default_node is not None:
        default_model = loader.build(ModelConfig, default_node[1], "default_model")
    models: list[ModelConfig] = []
    if models_node is not None:
        seq = models_node[1]
        if not isinstance(seq, yaml.SequenceNode):
            raise loader.fail(seq, "models", f"expected a list, got {_describe(seq)}")
        for i, item in enumerate(seq.value):
            entry = loader.build(ModelConfig, item, f"models[{i}]", base=default_model)
            if not any(key.value == "match" for key, _ in item.value):
                raise loader.fail(item, f"models[{i}]", "every model entry needs a 'match' (a name or glob)")
            models.append(entry)
    config = dataclasses.replace(config, default_model=default_model, models=tuple(models), source=source)
    _check(config, loader)
    return config


def _check(config: Config, loader: _Loader) -> None:
    admission = config.admission
    if admission.default_priority not in admission.priorities:
        raise ConfigError(
            f"{config.source}: admission.default_priority {admission.default_priority!r} is not one of "
            f"admission.priorities {list(admission.priorities)}"
        )
    water = admission.water
    for signal, yellow, red in (
        ("kv", water.yellow_kv, water.red_kv),
        ("stale", water.yellow_stale, water.red_stale),
    ):
        if yellow > red:
            # Red would rise first and yellow never show: a typo's swap, not a policy.
            raise ConfigError(
                f"{config.source}: admission.water.yellow_{signal} ({yellow:g}) must not exceed "
                f"admission.water.red_{signal} ({red:g})"
            )
    if admission.retry_after_min_s > admission.retry_after_max_s:
        raise ConfigError(
            f"{config.source}: admission.retry_after_min_s ({admission.retry_after_min_s:g}) must not "
            f"exceed admission.retry_after_max_s ({admission.retry_after_max_s:g})"
        )
    for i, agent in enumerate(config.interactive_headroom.agents if config.soft_pools.borrow else ()):
        if agent in config.headroom.agents:
            # One agent in both pools would be asked for long requests twice, under two roles.
            raise ConfigError(
                f"{config.source}: interactive_headroom.agents[{i}]: {agent} is also in headroom.agents; "
                "an agent belongs to one pool (its role says whether it lends: docs/operations.md, "
                '"Soft pools")'
            )
    _check_picker(config)
    if config.request.max_decompressed_bytes < config.request.max_body_bytes:
        raise ConfigError(
            f"{config.source}: request.max_decompressed_bytes must be >= request.max_body_bytes"
        )


def _check_picker(config: Config) -> None:
    """An endpoint picker names an engine for every request, so it needs the agents of both pools,
    and has nowhere to send the async pool's requests: an InferencePool's endpoints are engines."""
    if config.server.protocol != "endpoint-picker":
        return
    where = f"{config.source}: server.protocol endpoint-picker"
    for section, settings in (
        ("headroom", config.headroom),
        ("interactive_headroom", config.interactive_headroom),
    ):
        if not settings.agents and settings.dns is None:
            raise ConfigError(
                f"{where} picks engines from their agents: set {section}.agents or {section}.dns"
            )
    if config.admission.async_fallback:
        raise ConfigError(f"{where}: admission.async_fallback must be false (the async pool is no endpoint)")
    for i, model in enumerate((config.default_model, *config.models)):
        if model.async_mode not in (None, "never"):
            key = "default_model" if i == 0 else f"models[{i - 1}]"
            raise ConfigError(f"{where}: {key}.async_mode must be never (the async pool is no endpoint)")


def load_config(path: Path) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    return parse_config(text, str(path))
