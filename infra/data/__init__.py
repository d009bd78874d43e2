"""The data plane: ``DataProto`` batches, their Arrow IPC codec, fsspec storage and prompt datasets."""
