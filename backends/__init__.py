"""llmc backends."""
