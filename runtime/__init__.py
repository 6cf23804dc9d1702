"""llmc runtime."""
