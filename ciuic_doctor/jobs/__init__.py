"""The embedded DeepSeek-V3 job: the default patient every probe can run on any machine."""
