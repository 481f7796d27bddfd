"""A fuzzer for every input surface of mccld; see __main__.py for the command line."""
