"""Writes the Parquet fixtures with pyarrow (a real writer) and the rows they hold as JSON lines.

Run with pyarrow installed: python make.py  (pyarrow 26.0.1 made the committed files).
"""
import json
import pyarrow as pa
import pyarrow.parquet as pq

rows = []
for i in range(40):
    a, b = 3 * i + 1, 7 * i % 23
    rows.append({
        "question": f"Tom has {a} apples and buys {b} more. How many now?" + (" Think." if i % 3 == 0 else ""),
        "answer": f"He has {a} + {b} = {a + b}.\n#### {a + b}",
        "id": 1000 + i,
        "score": None if i % 4 == 1 else i / 8,
        "flag": i % 2 == 0,
        "tags": ["arith", "easy"] if i % 2 else ["arith"],
    })
table = pa.Table.from_pylist(rows)
# pyarrow's defaults (snappy, dictionary pages, v1 data pages), small pages and row groups, and a
# small dictionary page limit.
pq.write_table(table, "snappy.parquet", row_group_size=16, data_page_size=256,
               dictionary_pagesize_limit=200)
# Uncompressed, no dictionary, v2 data pages.
pq.write_table(table, "plain-v2.parquet", compression="none", use_dictionary=False,
               data_page_version="2.0", row_group_size=25)
# The other codecs pyarrow writes.
for codec in ["zstd", "gzip", "lz4"]:
    pq.write_table(table, f"{codec}.parquet", compression=codec)
with open("rows.jsonl", "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
