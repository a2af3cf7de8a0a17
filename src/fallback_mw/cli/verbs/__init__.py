"""Each verb's parser: its flags, help text and choices, and a handler that imports the verb's
module (cli/<verb>.py) when the verb runs. Parsing a command line (`fallback-mw --help`, a
usage error) imports only these, not the configuration models, the upstream engine, the
stores or the telemetry every verb together would pull in."""
