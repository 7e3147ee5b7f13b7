"""The benchmark suites: each a table of cases, a run function and a report of its payload."""
