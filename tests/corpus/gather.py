"""Rebuild the estimation corpus from text found on this machine (run once; the output is committed).

    python tests/corpus/gather.py                  every kind
    python tests/corpus/gather.py tools mixed      only these kinds

Kinds: English (rendered man pages), code (Python standard library), Chinese (zh_CN/zh_TW man pages,
vim's and the system's catalogs), other languages (European, Cyrillic, Japanese, Korean man pages; vim's
and the system's translation catalogs in Arabic, Hebrew, Indic, Thai, Greek, Georgian, Armenian,
Ethiopic, Vietnamese, ...), compact JSON (API examples, cloud resource dumps, ISO code lists, package
manifests: what a tool result or a pasted API response carries), pretty JSON (Kubernetes and JSON
schemas, SDK resource models, CLI trees, SBOMs), tool definitions (the compact JSON the gate counts for
`tools`: AWS operations, Google API methods and CloudFormation resources rendered as OpenAI or Anthropic
tool definitions) and mixed (package READMEs: prose, code, tables, links, a little JSON and emoji).

Each kind is split by source file into `train/` (fitting the shipped calibrations) and `heldout/`
(the tests and the benchmark), so no source feeds both; no source file feeds two kinds either. The
held-out files of English, code and Chinese are those first gathered (frozen): their training files
take only sources those do not hold. Different sources can still share text: boilerplate (licences,
the same untranslated man page paragraph in two languages) and, in pretty JSON, schema fragments that
many Kubernetes and SDK files repeat. Sources are walked in sorted order, so the corpus is the same on
every run of a machine.
"""

from __future__ import annotations

import gettext
import glob
import gzip
import html
import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MAN = Path("/usr/share/man")
STDLIB = Path(os.__file__).parent
# The system Python's packages: AWS SDK models and examples, CloudFormation schemas, moto's data.
SYSTEM_PACKAGES = Path("/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages")
VENV_PACKAGES = (
    Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / ("site-packages")
)
GCLOUD = Path("/usr/lib/google-cloud-sdk")
# The first kinds' held-out files are as they were first gathered (170 KB); their training files kept
# growing as the estimator learned more features.
TRAIN_BYTES = 400_000
HELDOUT_BYTES = 170_000
# Budgets of the kinds added for agent traffic: enough held-out text for several 32k-token pieces.
WIDE_TRAIN_BYTES = 800_000
WIDE_HELDOUT_BYTES = 240_000
# No single source file may fill a split: a kind should read like many documents.
FILE_BYTES = 40_000
WIDE_FILE_BYTES = 16_000
# Other languages: small pieces of many catalogs, so both splits hold every script, and more training
# text than other kinds: each script's blocks need their own weights.
LANGUAGE_FILE_BYTES = 6_000
LANGUAGE_TRAIN_BYTES = 800_000
OTHER_LANGUAGES = ("de", "fr", "ru", "ja", "ko", "pl", "uk", "es", "it", "pt_BR", "cs", "tr")
# Scripts the man pages lack, from the system's translation catalogs.
CATALOG_LANGUAGES = (
    "ar", "he", "hi", "bn", "ta", "th", "el", "ka", "am", "fa", "vi", "hy", "km", "te", "ml", "gu",
    "pa", "si", "ne", "kk", "be", "sr", "bg", "mk", "ur", "my", "mr", "kn",
)  # fmt: skip
CATALOG_MIN_BYTES = 12_000


def render_man(path: Path) -> str:
    """A man page as a reader sees it: groff output without overstrike or colour escapes."""
    source = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    rendered = subprocess.run(
        ["groff", "-man", "-Tutf8", "-P-cbou", "-Kutf8"],
        input=source,
        capture_output=True,
        check=False,
        env={**os.environ, "MANWIDTH": "80"},
    )
    return rendered.stdout.decode("utf-8", "replace")


def man_pages(*languages: str) -> Iterator[str]:
    for language in languages:
        base = MAN / language if language else MAN
        for path in sorted(base.glob("man[1-8]/*")):
            if path.is_file():
                yield render_man(path)


def english() -> Iterator[str]:
    yield from man_pages("")


def code() -> Iterator[str]:
    for path in sorted(STDLIB.glob("*.py")):
        yield path.read_text("utf-8", "replace")


def chinese() -> Iterator[str]:
    yield from catalogs("zh")
    yield from man_pages("zh_CN", "zh_TW")
    yield from interleave(system_catalogs("zh_CN"), system_catalogs("zh_TW"))


def _catalog_text(path: Path) -> str | None:
    with path.open("rb") as handle:
        try:
            catalog = gettext.GNUTranslations(handle)
        except (OSError, UnicodeDecodeError):
            return None
    messages = [value for key, value in catalog._catalog.items() if key and isinstance(value, str)]
    return "\n".join(messages)


def catalogs(prefix: str = "") -> Iterator[str]:
    for path in sorted(Path("/usr/share/vim").rglob("*.mo")):
        language = path.parent.parent.name
        if language.startswith("zh") != (prefix == "zh"):
            continue
        text = _catalog_text(path)
        if text is not None:
            yield text


def system_catalogs(language: str) -> Iterator[str]:
    """The larger translation catalogs of one language (country-name lists and tiny ones left out)."""
    for path in sorted(Path("/usr/share/locale", language, "LC_MESSAGES").glob("*.mo")):
        if path.stat().st_size < CATALOG_MIN_BYTES or path.name.startswith("iso_"):
            continue
        text = _catalog_text(path)
        if text is not None:
            yield text


def interleave(*sources: Iterator[str], turn: int = 1) -> Iterator[str]:
    """`turn` texts from each source in turn. `split` deals texts to the splits alternately, so with
    turn=2 every source gives its first text to one split and its second to the other."""
    pending = list(sources)
    while pending:
        for source in list(pending):
            taken = list(itertools.islice(source, turn))
            if not taken:
                pending.remove(source)
            yield from taken


def other_languages() -> Iterator[str]:
    pages = [man_pages(language) for language in OTHER_LANGUAGES]
    scripts = [system_catalogs(language) for language in CATALOG_LANGUAGES]
    yield from interleave(*pages, catalogs(), *scripts, turn=2)


# --- JSON -----------------------------------------------------------------------------------------


def _load(path: Path) -> Any:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def _newest(pattern: str) -> list[Path]:
    """Per service directory, the file of its newest API version (older versions repeat it)."""
    newest: dict[str, Path] = {}
    for name in sorted(glob.glob(pattern)):
        path = Path(name)
        newest[path.parent.parent.name] = path
    return [newest[service] for service in sorted(newest)]


def compact(document: Any, style: int) -> str:
    """Compact JSON as services send it: no whitespace, Python's `, `/`: ` separators, or ASCII escapes."""
    if style % 3 == 0:
        return json.dumps(document, separators=(",", ":"), ensure_ascii=False)
    if style % 3 == 1:
        return json.dumps(document, ensure_ascii=False)
    return json.dumps(document, separators=(",", ":"))


def pretty(document: Any, style: int) -> str:
    """Pretty JSON as people paste it: two- or four-space or tab indentation."""
    indent: int | str = (2, 4, "\t")[style % 3]
    return json.dumps(document, indent=indent, ensure_ascii=style % 2 == 0)


def aws_examples() -> Iterator[Any]:
    """Request and response examples of AWS APIs: IDs, ARNs, timestamps, nested objects."""
    for path in _newest(str(SYSTEM_PACKAGES / "botocore/data/*/*/examples-1.json")):
        examples = _load(path).get("examples", {})
        if len(json.dumps(examples)) > 3000:
            yield examples


def moto_resources() -> Iterator[Any]:
    """Resource dumps that moto serves as API responses (AMIs, managed rules, engine options, keys)."""
    skip = re.compile(r"/(latest_amis|optimized_amis|region|instance_type_offerings)/")
    seen_parents: set[str] = set()
    for name in sorted(glob.glob(str(SYSTEM_PACKAGES / "moto/**/resources/**/*.json*"), recursive=True)):
        path = Path(name)
        # One file per directory of near-identical siblings (one per region or engine).
        if skip.search(name) or str(path.parent) in seen_parents:
            continue
        seen_parents.add(str(path.parent))
        yield _load(path)


def iso_codes() -> Iterator[Any]:
    for path in sorted(Path("/usr/share/iso-codes/json").glob("iso_*.json")):
        yield _load(path)


def npm_manifests() -> Iterator[Any]:
    for name in sorted(glob.glob("/usr/lib/node_modules/npm/**/package.json", recursive=True)):
        path = Path(name)
        if path.stat().st_size > 1500:
            yield _load(path)


def compact_json() -> Iterator[str]:
    families = (aws_examples(), moto_resources(), iso_codes(), npm_manifests())
    for style, document in enumerate(interleave(*(map(json.dumps, f) for f in families))):
        yield compact(json.loads(document), style)


def kubernetes_schemas() -> Iterator[Any]:
    root = VENV_PACKAGES / "kubernetes_validate/kubernetes-json-schema/v1.37.0-local"
    for path in sorted(root.glob("*.json")):
        if path.stat().st_size > 3000 and not path.name.startswith("_definitions"):
            yield _load(path)


def sdk_resource_models() -> Iterator[Any]:
    for name in sorted(glob.glob(str(SYSTEM_PACKAGES / "boto3/data/*/*/resources-1.json"))):
        yield _load(Path(name))
    for name in sorted(glob.glob(str(GCLOUD / "lib/third_party/botocore/data/*/*/waiters-2.json"))):
        if Path(name).stat().st_size > 4000:
            yield _load(Path(name))


def schema_documents() -> Iterator[Any]:
    roots = (
        SYSTEM_PACKAGES / "samtranslator",
        SYSTEM_PACKAGES / "openapi_spec_validator",
        VENV_PACKAGES / "jsonschema_specifications",
        GCLOUD / "data/cli",
    )
    for root in roots:
        for name in sorted(glob.glob(str(root / "**/*.json"), recursive=True)):
            if Path(name).stat().st_size > 3000:
                yield _load(Path(name))
    for name in sorted(glob.glob(str(SYSTEM_PACKAGES / "*.dist-info/sboms/*.json"))):
        yield _load(Path(name))


def pretty_json() -> Iterator[str]:
    families = (kubernetes_schemas(), sdk_resource_models(), schema_documents())
    for style, document in enumerate(interleave(*(map(json.dumps, f) for f in families))):
        yield pretty(json.loads(document), style)


# --- tool definitions -----------------------------------------------------------------------------

_TAG = re.compile(r"<[^>]+>")
_SPACES = re.compile(r"\s+")
DESCRIPTION_CHARS = 600
MEMBER_DESCRIPTION_CHARS = 240
SCHEMA_DEPTH = 3


def plain(markup: str, limit: int) -> str:
    """Documentation HTML as a tool description: tags dropped, entities decoded, at most `limit`
    characters cut at a sentence end."""
    text = _SPACES.sub(" ", html.unescape(_TAG.sub(" ", markup))).strip()
    if len(text) <= limit:
        return text
    cut = text.rfind(". ", 0, limit)
    return text[: cut + 1] if cut > 0 else text[:limit]


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


# botocore's scalar shapes as JSON schema types.
AWS_SCALARS = {
    "integer": {"type": "integer"},
    "long": {"type": "integer"},
    "double": {"type": "number"},
    "float": {"type": "number"},
    "boolean": {"type": "boolean"},
    "timestamp": {"type": "string", "format": "date-time"},
}


def aws_schema(shapes: dict[str, Any], name: str, depth: int) -> dict[str, Any]:
    """A JSON schema for one botocore shape."""
    shape = shapes[name]
    kind = shape["type"]
    if kind == "structure":
        return aws_object(shapes, shape, depth)
    if kind == "list":
        return {"type": "array", "items": aws_schema(shapes, shape["member"]["shape"], depth + 1)}
    if kind == "map":
        return {
            "type": "object",
            "additionalProperties": aws_schema(shapes, shape["value"]["shape"], depth + 1),
        }
    if kind in AWS_SCALARS:
        return dict(AWS_SCALARS[kind])
    schema: dict[str, Any] = {"type": "string"}
    for key in ("enum", "pattern"):
        if key in shape:
            schema[key] = shape[key]
    return schema


def aws_object(shapes: dict[str, Any], shape: dict[str, Any], depth: int) -> dict[str, Any]:
    """A botocore structure as a JSON schema object, its members described (to SCHEMA_DEPTH levels)."""
    if depth >= SCHEMA_DEPTH:
        return {"type": "object"}
    properties = {}
    for member, spec in shape.get("members", {}).items():
        prop = aws_schema(shapes, spec["shape"], depth + 1)
        doc = plain(spec.get("documentation", ""), MEMBER_DESCRIPTION_CHARS)
        properties[member] = {**prop, "description": doc} if doc else prop
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if shape.get("required"):
        schema["required"] = shape["required"]
    return schema


def aws_tools() -> Iterator[list[tuple[str, str, dict[str, Any]]]]:
    """Per AWS service: (name, description, parameters) of each operation."""
    for path in _newest(str(SYSTEM_PACKAGES / "botocore/data/*/*/service-2.json.gz")):
        model = _load(path)
        shapes = model["shapes"]
        tools = []
        for name, operation in sorted(model["operations"].items()):
            shape = operation.get("input", {}).get("shape")
            parameters = aws_schema(shapes, shape, 0) if shape else {"type": "object", "properties": {}}
            tools.append(
                (_snake(name), plain(operation.get("documentation", ""), DESCRIPTION_CHARS), parameters)
            )
        yield tools


def google_tools() -> Iterator[list[tuple[str, str, dict[str, Any]]]]:
    """Per Google API discovery document: its methods with their parameters."""
    paths = sorted(glob.glob(str(GCLOUD / "**/discovery*/*.json"), recursive=True))
    paths += sorted(glob.glob(str(GCLOUD / "platform/gsutil/third_party/apitools/samples/*/*.json")))
    apis: set[str] = set()
    for name in paths:
        document = _load(Path(name))
        # Several files describe the same API (a sample and the CLI's copy): one source each.
        if "resources" not in document or document.get("name") in apis:
            continue
        apis.add(document.get("name"))
        tools = []
        stack = [document["resources"]]
        while stack:
            for resource in stack.pop().values():
                stack.append(resource.get("resources", {}))
                for method in resource.get("methods", {}).values():
                    properties = {}
                    for parameter, spec in method.get("parameters", {}).items():
                        prop = {"type": spec.get("type", "string")}
                        if "enum" in spec:
                            prop["enum"] = spec["enum"]
                        if spec.get("description"):
                            prop["description"] = plain(spec["description"], MEMBER_DESCRIPTION_CHARS)
                        properties[parameter] = prop
                    if "request" in method:
                        properties["body"] = {
                            "type": "object",
                            "description": f"A {method['request']['$ref']}.",
                        }
                    parameters: dict[str, Any] = {"type": "object", "properties": properties}
                    if method.get("parameterOrder"):
                        parameters["required"] = method["parameterOrder"]
                    description = plain(method.get("description", ""), DESCRIPTION_CHARS)
                    tools.append((method["id"].replace(".", "_"), description, parameters))
        yield tools


def _resolve(schema: Any, definitions: dict[str, Any], depth: int) -> Any:
    if isinstance(schema, dict):
        reference = schema.get("$ref", "")
        if reference.startswith("#/definitions/"):
            if depth >= SCHEMA_DEPTH:
                return {"type": "object"}
            return _resolve(definitions.get(reference.split("/")[-1], {}), definitions, depth + 1)
        return {key: _resolve(value, definitions, depth) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_resolve(value, definitions, depth) for value in schema]
    return schema


def cloudformation_tools() -> Iterator[list[tuple[str, str, dict[str, Any]]]]:
    """CloudFormation resource types as `create_<type>` tools, a few types per service."""
    by_service: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for name in sorted(glob.glob(str(SYSTEM_PACKAGES / "cfnlint/data/schemas/resources/*.json"))):
        schema = _load(Path(name))
        type_name = schema.get("typeName", "")
        if not type_name.startswith("AWS::"):
            continue
        definitions = schema.get("definitions", {})
        parameters = {
            "type": "object",
            "properties": _resolve(schema.get("properties", {}), definitions, 0),
            "required": schema.get("required", []),
        }
        description = schema.get("description", f"Create a {type_name} resource.")
        tool = ("create_" + _snake(type_name.replace("::", "_")), description, parameters)
        by_service.setdefault(type_name.split("::")[1], []).append(tool)
    for service in sorted(by_service):
        yield by_service[service]


def tool_definition(name: str, description: str, parameters: dict[str, Any], style: int) -> Any:
    """One tool in the OpenAI chat (`function`), OpenAI responses or Anthropic (`input_schema`) shape."""
    if style % 3 == 0:
        return {
            "type": "function",
            "function": {"name": name, "description": description, "parameters": parameters},
        }
    if style % 3 == 1:
        return {"type": "function", "name": name, "description": description, "parameters": parameters}
    return {"name": name, "description": description, "input_schema": parameters}


def tools() -> Iterator[str]:
    """A request's tool definitions as the gate counts them: each tool's compact JSON, one after another."""
    families = (aws_tools(), google_tools(), cloudformation_tools())
    for style, source in enumerate(interleave(*(map(json.dumps, f) for f in families))):
        definitions = json.loads(source)
        yield "".join(
            json.dumps(tool_definition(*tool, style), separators=(",", ":"), ensure_ascii=False)
            for tool in definitions
        )


# --- mixed ----------------------------------------------------------------------------------------


def readme(metadata: str) -> str:
    """The long description of a package's METADATA: what follows the header block."""
    _, _, body = metadata.partition("\n\n")
    return body


def mixed() -> Iterator[str]:
    """Package READMEs (Markdown or reStructuredText): prose, code blocks, tables, links, badges."""
    seen: set[str] = set()
    for root in (VENV_PACKAGES, SYSTEM_PACKAGES):
        for path in sorted(root.glob("*.dist-info/METADATA")):
            package = path.parent.name.split("-")[0].lower()
            # kvgate's own README changes with this repository.
            if package in seen or package == "kvgate":
                continue
            seen.add(package)
            body = readme(path.read_text("utf-8", "replace"))
            if len(body) > 3000:
                yield body
    for name in sorted(glob.glob("/usr/share/doc/*/README.md*")):
        path = Path(name)
        yield (gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()).decode(
            "utf-8", "replace"
        )


def split(texts: Iterator[str], name: str, budgets: dict[str, int], file_bytes: int, frozen: bool) -> None:
    """Alternate whole source files between the splits until each holds its byte budget.

    `frozen`: the held-out file stays as committed, and training takes only sources it does not hold
    (a source is known by its first line of text), so a bigger training budget cannot leak into it.
    """
    held_out_path = HERE / "heldout" / f"{name}.txt"
    held_out = held_out_path.read_text("utf-8") if frozen else ""
    parts: dict[str, list[str]] = {"train": [], "heldout": []}
    sizes = dict.fromkeys(budgets, 0)
    if frozen:
        sizes["heldout"] = budgets["heldout"]
    turn = 0
    for raw in texts:
        text = raw.strip()
        if len(text) < 200 or (frozen and _opening(text) in held_out):
            continue
        open_splits = [s for s in budgets if sizes[s] < budgets[s]]
        if not open_splits:
            break
        target = open_splits[turn % len(open_splits)]
        turn += 1
        encoded = text.encode("utf-8")[: min(file_bytes, budgets[target] - sizes[target])].decode(
            "utf-8", "ignore"
        )
        parts[target].append(encoded)
        sizes[target] += len(encoded.encode("utf-8"))
    for target, texts_of_split in parts.items():
        out = HERE / target / f"{name}.txt"
        if frozen and target == "heldout":
            continue
        out.parent.mkdir(exist_ok=True)
        out.write_text("\n\n".join(texts_of_split) + "\n", "utf-8")
        print(f"{out.relative_to(HERE)}: {sizes[target]} bytes from {len(texts_of_split)} files")


def _opening(text: str) -> str:
    """The first non-blank line of a source, stripped: what identifies it in a split file."""
    return next(line.strip() for line in text.splitlines() if line.strip())


NARROW = {"train": TRAIN_BYTES, "heldout": HELDOUT_BYTES}
WIDE = {"train": WIDE_TRAIN_BYTES, "heldout": WIDE_HELDOUT_BYTES}
LANGUAGES = {"train": LANGUAGE_TRAIN_BYTES, "heldout": WIDE_HELDOUT_BYTES}
# Per kind: its sources, split budgets, bytes per source, and whether its held-out file is frozen.
KINDS: dict[str, tuple[Callable[[], Iterator[str]], dict[str, int], int, bool]] = {
    "english": (english, NARROW, FILE_BYTES, True),
    "code": (code, NARROW, FILE_BYTES, True),
    "chinese": (chinese, {**NARROW, "train": LANGUAGE_TRAIN_BYTES}, FILE_BYTES, True),
    "other": (other_languages, LANGUAGES, LANGUAGE_FILE_BYTES, False),
    "compact_json": (compact_json, WIDE, WIDE_FILE_BYTES, False),
    "pretty_json": (pretty_json, WIDE, WIDE_FILE_BYTES, False),
    "tools": (tools, WIDE, WIDE_FILE_BYTES, False),
    "mixed": (mixed, WIDE, WIDE_FILE_BYTES, False),
}


def main(names: list[str]) -> None:
    unknown = set(names) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown kinds: {', '.join(sorted(unknown))}; known: {', '.join(KINDS)}")
    for name in names or KINDS:
        source, budgets, file_bytes, frozen = KINDS[name]
        split(source(), name, budgets, file_bytes, frozen)


if __name__ == "__main__":
    main(sys.argv[1:])
