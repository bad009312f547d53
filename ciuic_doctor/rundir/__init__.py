"""The run directory: every file format a run holds, its schema, and safe reading and writing.

    store            RunDir: meta.json, streams (JSONL, appended and flushed per record), JSON files
    schemas          each stream's record schema; readers drop records that do not fit
    stream_read      the JSONL reader: torn lines and off-schema records skipped and counted
    frames/          streams as arrow tables and pandas frames (assemble, parts), the columnar cache
    columnar_schema  the arrow schema of each stream; parquet_store: `compact`'s Parquet copy
    safe_io          no symlinks, size caps, O_NOFOLLOW: a run directory is data written by anyone
    findings         the findings schema every analysis returns
    watch_end        how a watched run ended, as meta.json says it or its readers can still tell
    hang/            hang dumps: per-rank files, their shapes, torch's Flight Recorder dumps

Everything above reads and writes runs through this package; it imports nothing above the floor.
"""
