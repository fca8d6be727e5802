"""What a trainer keeps: delta checkpoints beside the full ones, and the versioned
SavedModel exports."""
