"""``memtui run``: start a command with memtui's start-up hook in every Python process it runs."""
