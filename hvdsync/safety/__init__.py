"""Safety and recovery, for both adapters: the ranks' agreement on their setup, entry tags, the
watchdog on every wait, the checkpoint format and Horovod Elastic's reset loop
(docs/failures.md, docs/checkpoints.md, docs/elastic.md)."""
