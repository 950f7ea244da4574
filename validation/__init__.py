"""The tile math of validation: the Freivalds check of a tile against its operands."""
