"""How a config tree of pydantic sections is told apart and shown to people.

Tagged sections: a field annotated `Annotated[Union[Annotated[A, Tag("a")], ...], Discriminator(TagOf(key,
default))]` holds one model per value of `key` (e.g. `transport.kind`), each with only its own
fields; a section that omits `key` gets `default`. Pydantic reports errors inside such a section at
a location that includes the tag (`('transport', 'shm', 'bucket_mb')`); `explain` drops the tag
and says which value of the key a misplaced field belongs to:
`transport.bucket_mb: only for transport.kind 'broadcast' (kind is 'shm')`.

`reference(root)` renders every field as Markdown tables: one per section, and for a tagged
section one table of the fields every variant has plus one table per variant.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationError
from pydantic.fields import FieldInfo


class Section(BaseModel):
    """A config section: unknown fields are errors, values are frozen, attribute docstrings document fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TagOf:
    """Discriminator of a tagged section: the value of `key`, or `default` when a mapping omits it."""

    def __init__(self, key: str, default: str) -> None:
        self.key, self.default = key, default
        self.__name__ = key  # pydantic names the discriminator by it in its own messages

    def __call__(self, value: Any) -> Any:
        if isinstance(value, dict):
            return value.get(self.key, self.default)
        return getattr(value, self.key, None)


@dataclass(frozen=True)
class Variants:
    """The models of one tagged section, by tag."""

    key: str
    default: str
    models: dict[str, type[BaseModel]]

    def key_field(self) -> FieldInfo:
        """The key as the variants' shared base declares it (its docstring; the default tag)."""
        first = next(iter(self.models.values()))
        declared = [
            c.model_fields[self.key] for c in first.__mro__ if issubclass(c, BaseModel) and self.key in c.model_fields
        ]
        described = next((f for f in declared if f.description), declared[0])
        return FieldInfo.merge_field_infos(described, default=self.default)

    def common(self) -> list[str]:
        """Fields every variant has, in declaration order (the key first)."""
        first, *others = self.models.values()
        return [n for n in first.model_fields if all(n in m.model_fields for m in others)]


def variants(field: FieldInfo) -> Variants | None:
    """The variants of a tagged section field, or None for any other field."""
    tag_of = next((m.discriminator for m in field.metadata if isinstance(m, Discriminator)), None)
    if not isinstance(tag_of, TagOf):
        return None
    models: dict[str, type[BaseModel]] = {}
    for member in get_args(field.annotation):
        model, *meta = get_args(member)
        models[next(m.tag for m in meta if isinstance(m, Tag))] = model
    return Variants(tag_of.key, tag_of.default, models)


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section model of a field, also when the section is optional (`Section | None`)."""
    members = get_args(annotation)
    if len(members) == 2 and type(None) in members:
        annotation = next(m for m in members if m is not type(None))
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _mapped_section(annotation: Any) -> type[BaseModel] | None:
    """The value section of a `dict[str, Section]` field (sections by name), else None."""
    if get_origin(annotation) is not dict:
        return None
    value = get_args(annotation)[1]
    return value if isinstance(value, type) and issubclass(value, BaseModel) else None


def _optional_section(annotation: Any) -> type[BaseModel] | None:
    """The section of a `Section | None` field (off unless given), else None."""
    members = [a for a in get_args(annotation) if a is not type(None)]
    return _section(members[0]) if len(members) == 1 and type(None) in get_args(annotation) else None


@dataclass
class _Place:
    """Where an error location points: its dotted path without tags, and the section that holds its last key."""

    path: str
    section: type[BaseModel] | None
    within: tuple[str, str, Variants] | None  # (section path, tag, variants) when the section is one variant


def _locate(root: type[BaseModel], loc: tuple[Any, ...]) -> _Place:
    model: type[BaseModel] | None = root
    within: tuple[str, str, Variants] | None = None
    place = _Place("", root, None)
    path: list[str] = []
    rest = [str(p) for p in loc]
    while rest:
        key = rest.pop(0)
        path.append(key)
        place = _Place(".".join(path), model, within)
        field = model.model_fields.get(key) if model is not None else None
        tagged = variants(field) if field is not None else None
        if tagged is not None and rest and rest[0] in tagged.models:
            tag = rest.pop(0)
            model, within = tagged.models[tag], (".".join(path), tag, tagged)
        elif field is not None and _mapped_section(field.annotation) is not None and rest:
            path.append(rest.pop(0))  # the key of a section by name, e.g. the role of env.policies.<role>
            model, within = _mapped_section(field.annotation), None
        else:
            model, within = (_section(field.annotation) if field is not None else None), None
    place.path = ".".join(path)
    return place


def _unknown(place: _Place, key: str) -> str:
    if place.within is not None:
        section_path, tag, tagged = place.within
        owners = [t for t, m in tagged.models.items() if key in m.model_fields]
        if owners:
            kinds = " or ".join(repr(t) for t in owners)
            return f"only for {section_path}.{tagged.key} {kinds} ({tagged.key} is {tag!r})"
        known = list(dict.fromkeys(n for m in tagged.models.values() for n in m.model_fields))
    else:
        known = list(place.section.model_fields) if place.section is not None else []
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else (f" (known: {', '.join(known)})" if known else "")
    return f"unknown field{hint}"


def explain(err: ValidationError, root: type[BaseModel]) -> str:
    """One line per problem, each starting with the dotted field it concerns; a single problem is
    one line in all, so the command line's message for it is one line too."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        place = _locate(root, loc)
        field = place.path or "config"
        if e["type"] == "extra_forbidden":
            lines.append(f"{field}: {_unknown(place, str(loc[-1]))}")
        elif e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            info = place.section.model_fields.get(str(loc[-1])) if place.section is not None and loc else None
            tagged = variants(info) if info is not None else None
            key = tagged.key if tagged is not None else "kind"
            if e["type"] == "union_tag_invalid":
                lines.append(f"{field}.{key}: expected one of {e['ctx']['expected_tags']} (got {e['ctx']['tag']!r})")
            else:
                lines.append(f"{field}: expected a section (a mapping of fields) (got {e.get('input')!r})")
        elif e["type"] == "value_error":  # a rule across sections names its fields itself
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{field}: {msg}" if place.path else msg)
        else:
            lines.append(f"{field}: {e['msg']} (got {e.get('input')!r})")
    return f"invalid config: {lines[0]}" if len(lines) == 1 else "invalid config:\n  " + "\n  ".join(lines)


def _type_name(annotation: Any) -> str:
    name = (
        str(annotation).replace("typing.", "")
        if get_args(annotation)
        else getattr(annotation, "__name__", str(annotation))
    )
    name = re.sub(r"nonstop\.[\w.]+\.(\w+)", r"\1", name)  # a section by its class name, not its module path
    return name.replace("<class '", "").replace("'>", "").replace("|", "or")


def _row(path: str, field: FieldInfo, type_name: str | None = None) -> str:
    desc = " ".join((field.description or "").replace("|", "\\|").split())
    default = "required" if field.is_required() else f"`{field.default!r}`"
    return f"| `{path}` | {type_name or _type_name(field.annotation)} | {default} | {desc} |"


def reference(root: type[BaseModel], title: str) -> str:
    """Markdown tables of every field of `root`: type, default and its attribute docstring."""
    lines = [f"# {title}", "", "Generated by `nonstop config --markdown`.", ""]

    def table(heading: str, intro: str, rows: list[str]) -> None:
        lines.extend([f"## {heading}", ""])
        if intro:
            lines.extend([intro, ""])
        if rows:
            lines.extend(["| field | type | default | meaning |", "|---|---|---|---|", *rows, ""])

    def section(
        model: type[BaseModel], prefix: str, names: list[str], heading: str, intro: str = "", suffix: str = ""
    ) -> None:
        rows, nested, by_name = [], [], []
        for name in names:
            field = model.model_fields[name]
            tagged = variants(field)
            if tagged is not None or _section(field.annotation) is not None:
                nested.append((name, field, tagged))
            else:
                rows.append(_row(prefix + name, field))
                if _optional_section(field.annotation) is not None:
                    nested.append((name, field, None))
                mapped = _mapped_section(field.annotation)
                if mapped is not None:
                    by_name.append((prefix + name, mapped))
        if rows or intro:
            table(heading + suffix, intro, rows)
        for keyed, value_section in by_name:
            section(
                value_section,
                f"{keyed}.<name>.",
                list(value_section.model_fields),
                f"{keyed}.<name>",
                " ".join((value_section.__doc__ or "").split()),
                suffix=suffix,
            )
        for name, field, tagged in nested:
            path = prefix + name
            sub = _section(field.annotation) or _optional_section(field.annotation)
            if sub is not None:
                optional = _section(field.annotation) is None
                section(
                    sub,
                    f"{path}.",
                    list(sub.model_fields),
                    path,
                    " ".join((sub.__doc__ or "").split()) if optional else "",
                    suffix=suffix,
                )
                continue
            assert tagged is not None
            common = tagged.common()
            first = next(iter(tagged.models.values()))
            tags = " or ".join(repr(t) for t in tagged.models)
            key_field = tagged.key_field()
            table(
                path,
                f"Fields of every `{path}.{tagged.key}`; each {tagged.key} adds its own below, and a field "
                f"given for another {tagged.key} is an error.",
                [_row(f"{path}.{tagged.key}", key_field, tags)]
                + [_row(f"{path}.{n}", first.model_fields[n]) for n in common if n != tagged.key],
            )
            for tag, variant in tagged.models.items():
                own = [n for n in variant.model_fields if n not in common]
                doc = " ".join((variant.__doc__ or "").split())
                intro = doc + ("" if own else " No fields of its own.")
                section(variant, f"{path}.", own, path, intro.strip(), f" ({tagged.key}: {tag})")

    section(root, "", list(root.model_fields), "top level")
    return "\n".join(lines)
