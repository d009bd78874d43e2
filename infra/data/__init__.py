"""The data plane: ``DataProto`` batches, their Arrow IPC codec, fsspec storage (writes through one
backend per protocol, ``storage_backends/``) and prompt datasets."""
