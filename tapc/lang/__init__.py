"""The tap language: the grammar (`taps.lark`, package data), tap strings as plain values
(`syntax`), the edit ops and their arguments (`edits`), blocks named by import path
(`blockpaths`) and YAML specs (`specfile`). It knows no model, planner or engine."""
