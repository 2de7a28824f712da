"""The tap language: the grammar (`taps.lark`, package data), tap strings as plain values
(`syntax`), the edit ops and their arguments (`edits`), blocks named by import path
(`blockpaths`) and how they are called (`blocks`), compiled functions' declarations
(`functions`), YAML specs (`specfile`) read from text (`yamltext`) against their schema
(`schema`), and values quoted in errors (`quoted`). It knows no model, planner or engine."""
