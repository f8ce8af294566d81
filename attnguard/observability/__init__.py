"""What attnguard says: events and their sinks, the vocabulary of reasons, the per-process and
job-wide summaries, and the files and job directory they are read back from."""
