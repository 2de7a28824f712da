"""The tap DSL grammar (Lark), shipped as package data."""
