"""Input processing in the front end: bound the work, decode media in a fair worker pool, build the prompt."""
