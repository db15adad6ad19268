"""The ``mesh-inference`` command: argument parsing, tables for people, and the one place errors become messages."""
