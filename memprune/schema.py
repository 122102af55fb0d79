"""The corpus tables as explicit Arrow schemas, their validator and the stable ids.

Every stage reads one of these tables and writes one; the schemas are the contract
between stages (see DESIGN.md, "Data"). Ids are plain strings derived from the source,
so a rerun or a resume produces the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from memprune.errors import MemPruneError

TURN = pa.struct(
    [
        pa.field("turn_id", pa.string(), nullable=False),
        pa.field("speaker", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
    ]
)

SESSIONS = pa.schema(
    [
        pa.field("conversation_id", pa.string(), nullable=False),
        pa.field("session_index", pa.int32(), nullable=False),
        pa.field("speakers", pa.list_(pa.string()), nullable=False),
        pa.field("turns", pa.list_(TURN), nullable=False),
        pa.field("time", pa.string(), nullable=True),
    ]
)

BULLETS = pa.schema(
    [
        pa.field("bullet_id", pa.string(), nullable=False),
        pa.field("conversation_id", pa.string(), nullable=False),
        pa.field("session_index", pa.int32(), nullable=False),
        pa.field("speaker", pa.string(), nullable=True),
        pa.field("text", pa.string(), nullable=False),
        pa.field("evidence", pa.list_(pa.string()), nullable=False),
    ]
)

# Synthetic corpora store the ground truth with each bullet: does the fact recur later?
SYNTH_BULLETS = BULLETS.append(pa.field("recurs", pa.bool_(), nullable=False)).append(
    pa.field("kind", pa.string(), nullable=False)
)

QA = pa.schema(
    [
        pa.field("qa_id", pa.string(), nullable=False),
        pa.field("conversation_id", pa.string(), nullable=False),
        pa.field("question", pa.string(), nullable=False),
        pa.field("answer", pa.string(), nullable=True),
        pa.field("evidence", pa.list_(pa.string()), nullable=False),
        pa.field("category", pa.int32(), nullable=True),
    ]
)

PAIRS = pa.schema(
    [
        pa.field("bullet_id", pa.string(), nullable=False),
        pa.field("turn_id", pa.string(), nullable=False),
        pa.field("score", pa.float64(), nullable=True),
        pa.field("judge", pa.string(), nullable=False),
        pa.field("error", pa.string(), nullable=True),
    ]
)

LABELS = pa.schema(
    [
        pa.field("bullet_id", pa.string(), nullable=False),
        pa.field("label", pa.float64(), nullable=False),
        pa.field("n_pairs", pa.int32(), nullable=False),
        pa.field("aggregation", pa.string(), nullable=False),
        # judge | qa | usage (memprune.label.sources); optional: tables written before it existed lack it
        pa.field("source", pa.string(), nullable=False),
    ]
)

SCORES = pa.schema(
    [
        pa.field("bullet_id", pa.string(), nullable=False),
        pa.field("score", pa.float64(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("seed", pa.int32(), nullable=False),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "sessions": SESSIONS,
    "bullets": BULLETS,
    "qa": QA,
    "pairs": PAIRS,
    "labels": LABELS,
    "scores": SCORES,
}

# Primary key of each table: must be unique and non-null.
# Columns a table may lack (older tables); when present they must match the schema.
OPTIONAL: dict[str, tuple[str, ...]] = {"labels": ("source",)}

KEYS: dict[str, tuple[str, ...]] = {
    "sessions": ("conversation_id", "session_index"),
    "bullets": ("bullet_id",),
    "qa": ("qa_id",),
    "pairs": ("bullet_id", "turn_id"),
    "labels": ("bullet_id",),
    "scores": ("bullet_id", "model", "stage", "seed"),
}


class SchemaError(MemPruneError):
    """A table does not match its schema; the message names the source, table and column."""


@dataclass(frozen=True)
class Problem:
    """One schema violation: which column and what is wrong with it."""

    column: str
    reason: str

    def __str__(self) -> str:
        return f"column {self.column!r}: {self.reason}"


def compatible(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether a column of type `src` holds values of `dst` in another encoding (cast on read).

    Tables written by pandas or polars use large_string or string_view for text, int64 for every
    integer and large lists: the same values as memprune's schema, so they are accepted and cast.
    """
    if src.equals(dst):
        return True
    text = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    if any(f(src) for f in text) and any(f(dst) for f in text):
        return True
    if pa.types.is_integer(src) and pa.types.is_integer(dst):
        return True
    if pa.types.is_floating(dst) and (pa.types.is_floating(src) or pa.types.is_integer(src)):
        return True
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_list_view, pa.types.is_large_list_view)
    if any(f(src) for f in lists) and any(f(dst) for f in lists):
        return compatible(src.value_type, dst.value_type)
    if pa.types.is_struct(src) and pa.types.is_struct(dst):
        names = [src.field(i).name for i in range(src.num_fields)]
        return names == [dst.field(i).name for i in range(dst.num_fields)] and all(
            compatible(src.field(i).type, dst.field(i).type) for i in range(dst.num_fields))
    return False


def conform_table(table: pa.Table, name: str, source: str = "<table>") -> pa.Table:
    """Cast the columns of `table` whose type is compatible with table `name`'s schema to the schema's type.

    An integer that does not fit the schema's width is an error naming the column, never wrapped.
    Incompatible columns are left for `validate_table` to report.
    """
    schema = TABLES[name]
    for field in schema:
        if field.name not in table.column_names:
            continue
        i = table.column_names.index(field.name)
        col = table.column(i)
        if col.type.equals(field.type) or not compatible(col.type, field.type):
            continue
        try:
            cast = col.cast(field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise SchemaError(f"{source}: column {field.name!r} of type {col.type} cannot be read as {field.type}: "
                              f"{str(exc).splitlines()[0]}") from None
        table = table.set_column(i, pa.field(field.name, field.type, field.nullable), cast)
    return table


def check_table(table: pa.Table, name: str) -> list[Problem]:
    """List every way `table` violates the schema of table `name` (extra columns are allowed)."""
    schema = TABLES[name] if name in TABLES else None
    if schema is None:
        raise KeyError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
    problems: list[Problem] = []
    for field in schema:
        if field.name not in table.column_names:
            if field.name not in OPTIONAL.get(name, ()):
                problems.append(Problem(field.name, "missing"))
            continue
        column = table.column(field.name)
        if not column.type.equals(field.type):
            problems.append(Problem(field.name, f"type {column.type}, expected {field.type}"))
            continue
        if not field.nullable and column.null_count:
            problems.append(Problem(field.name, f"{column.null_count} null value(s) in a required column"))
        elif pa.types.is_list(field.type) and column.num_chunks:
            items = pa.chunked_array([c.flatten() for c in column.chunks], field.type.value_type)
            if items.null_count:
                problems.append(Problem(field.name, f"{items.null_count} null item(s) inside the lists"))
    if problems:
        return problems
    key = KEYS[name]
    if table.num_rows:
        counts = table.group_by(list(key)).aggregate([([], "count_all")])
        dupes = counts.filter(pa.compute.greater(counts.column("count_all"), 1))
        if dupes.num_rows:
            example = {k: dupes.column(k)[0].as_py() for k in key}
            problems.append(Problem(",".join(key), f"{dupes.num_rows} duplicate key(s), e.g. {example}"))
    return problems


def validate_table(table: pa.Table, name: str, source: str = "<table>") -> pa.Table:
    """Raise `SchemaError` naming `source`, the table and each bad column; return the table."""
    problems = check_table(table, name)
    if problems:
        details = "; ".join(str(p) for p in problems)
        raise SchemaError(f"{source}: not a valid {name!r} table: {details}")
    return table


# ---------------------------------------------------------------- stable ids


def turn_id(conversation_id: str, session_index: int, turn_index: int) -> str:
    """Id of the turn at position `turn_index` (0-based, in the source) of a session."""
    return f"{conversation_id}:s{session_index}:t{turn_index}"


def bullet_id(conversation_id: str, session_index: int, bullet_index: int) -> str:
    """Id of the bullet at position `bullet_index` (0-based, in the source) of a session."""
    return f"{conversation_id}:s{session_index}:b{bullet_index}"


def qa_id(conversation_id: str, qa_index: int) -> str:
    """Id of the QA item at position `qa_index` (0-based, in the source) of a conversation."""
    return f"{conversation_id}:q{qa_index}"
