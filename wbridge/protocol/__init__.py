"""What crosses the store and the wire: key names, sealed records, the version record, slot stamps
and chunk checksums. Publisher and subscriber both speak it; nothing here moves bytes."""
