"""mccld's host: harvesting idle time (activity, keep-awake), launching jobs under their own
identity and priority, the process trees it owns and reclaiming the machine from them."""
