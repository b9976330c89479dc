"""Before a run: the memory a training job will need (``memtui estimate``) and this host's GPUs
(``memtui gpus``)."""
