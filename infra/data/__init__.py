"""The data plane: the batches that flow between the steps, and the files they live in.

dataproto.py      DataProto: tensors, non-tensor columns and meta_info sharing dim 0
arrow_codec.py    a DataProto as one Arrow IPC file, never pickle
arrow_columns.py  one tensor column <-> one Arrow array and its metadata
arrow_objects.py  object columns <-> Arrow arrays, exactly or not at all
storage.py        fsspec storage: URLs, atomic writes, listing, removal
storage_backends/ one backend per protocol: create-if-absent, replace/delete-if-match, atomic publish
hashing.py        content hashes of stored files (xxh3-64)
prompts.py        prompt parquet files in veRL's format, in a resumable deterministic order
stream.py         training data that grows: entries as files, directories or globs
"""
