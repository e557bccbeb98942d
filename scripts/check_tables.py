"""Reads every table of an evalflow run with pyarrow and DuckDB and checks that the
columns declared in schemas/*.json are present with the declared types.

Usage: python3 scripts/check_tables.py RUN_ROOT
Prints one line per table and exits non-zero on the first mismatch.
"""
import glob
import json
import os
import sys

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

ARROW = {
    "utf8": (pa.string(), pa.large_string(), pa.string_view()),
    "float64": (pa.float64(),),
    "int32": (pa.int32(),),
    "int64": (pa.int64(),),
    "bool": (pa.bool_(),),
    "timestamp_us_utc": (pa.timestamp("us", tz="UTC"),),
    "list<bool>": (pa.list_(pa.bool_()),),
}
DUCK = {
    "utf8": ("VARCHAR",),
    "float64": ("DOUBLE",),
    "int32": ("INTEGER",),
    "int64": ("BIGINT",),
    "bool": ("BOOLEAN",),
    "timestamp_us_utc": ("TIMESTAMP WITH TIME ZONE",),
    "list<bool>": ("BOOLEAN[]",),
}


def main(root):
    here = os.path.dirname(os.path.abspath(__file__))
    schemas = os.path.join(here, "..", "schemas")
    con = duckdb.connect()
    for name in ["cases", "calls", "validity", "scores", "results"]:
        decl = json.load(open(os.path.join(schemas, name + ".json")))
        files = sorted(glob.glob(os.path.join(root, name, "**", "*.parquet"), recursive=True))
        if not files:
            sys.exit(f"{name}: no parquet files under {root}/{name}")
        table = pa.concat_tables([pq.read_table(f) for f in files])
        rel = con.sql(f"SELECT * FROM read_parquet({files!r})")
        duck_types = dict(zip(rel.columns, [str(t) for t in rel.types]))
        for f in decl["fields"]:
            got = table.schema.field(f["name"]).type
            if got not in ARROW[f["type"]]:
                sys.exit(f"{name}.{f['name']}: pyarrow type {got}, declared {f['type']}")
            dt = duck_types.get(f["name"])
            if dt not in DUCK[f["type"]]:
                sys.exit(f"{name}.{f['name']}: duckdb type {dt}, declared {f['type']}")
        n = con.execute(f"SELECT count(*) FROM read_parquet({files!r})").fetchall()[0][0]
        if n != table.num_rows:
            sys.exit(f"{name}: duckdb counts {n} rows, pyarrow {table.num_rows}")
        print(f"{name}: {table.num_rows} rows, {len(decl['fields'])} declared columns ok")


if __name__ == "__main__":
    main(sys.argv[1])
