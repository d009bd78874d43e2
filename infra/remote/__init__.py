"""The rank runtime: worker groups started with torch's launcher, their control channel, dispatch
modes, and fault drills."""
