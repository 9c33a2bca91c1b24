package iotlake.hadoop;

import org.apache.hadoop.fs.LocalFileSystem;

/** {@code fs.file.impl}: the checksummed local file system over {@link NioRawLocalFileSystem}. */
public class NioLocalFileSystem extends LocalFileSystem {
  public NioLocalFileSystem() {
    super(new NioRawLocalFileSystem());
  }
}
