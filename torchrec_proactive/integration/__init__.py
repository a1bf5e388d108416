"""TorchRec-facing layer: sharder, sharded module, kernel and pipeline."""
